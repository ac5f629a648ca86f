"""``python -m lit_rlhf …`` = ``lit-rlhf …`` (lit_rlhf/launch/command.py)."""

from lit_rlhf.launch.command import main

if __name__ == "__main__":
    main()
