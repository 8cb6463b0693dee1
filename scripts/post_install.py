"""Post-install fix-ups that pip cannot express, applied inside the project's .venv only.

Idempotent: running it twice changes nothing the second time.
"""

from __future__ import annotations


def main() -> None:
    # Nothing to fix yet for the trainer-only install; the SGLang CPU set-up adds its steps here.
    print("post_install: ok")


if __name__ == "__main__":
    main()
