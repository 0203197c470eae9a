"""The program `llm-server --hosts` has mlx.launch start on each host: the CLI itself."""

import sys

from llm_server.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
