"""Agentic rollouts, the pieces below the agent loop: tools and their call-markup parser, the
bubblewrap sandbox for untrusted Python, gym-style environments (calculator, sandboxed Python,
guess-a-number) and the chat templates for token-in-token-out trajectories with their append-only
checker. Pure Python (plus Jinja2): no torch, no transformers."""
