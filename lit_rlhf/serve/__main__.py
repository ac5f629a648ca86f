"""``python -m lit_rlhf.serve``: the reward-model server (server.py)."""

from lit_rlhf.serve.server import main

if __name__ == "__main__":
    main()
