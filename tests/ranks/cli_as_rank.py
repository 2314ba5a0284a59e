"""Run one `reshard` command the way `python -m reshard` does, as S3 access key `rank{RANK}`.

usage: cli_as_rank.py ARGS...
The test's S3 server logs the access key of every request, so it can tell which rank sent which object.
"""

import os
import sys

os.environ["AWS_ACCESS_KEY_ID"] = f"rank{os.environ['RANK']}"

from reshard.cli import main  # noqa: E402  after the key is set

if __name__ == "__main__":
    sys.argv[0] = "reshard"
    main()
