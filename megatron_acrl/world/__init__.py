"""The trainer world: process groups and their start, the rank-0 decision every rank follows, and
the entry point's stop signals."""
