"""Every rank opens its process set's progress board, posts one beat, and reads every member's:
what each rank reached is written to ``rank<r>.json``. Launched by the test with each rank in a
network namespace of its own on one machine: the ranks share a host name but not a network."""

from __future__ import annotations

import argparse
import json
import socket
import time
from pathlib import Path

import horovod.torch as hvd
import torch

from grace_legacy.backends.board import interface_addresses
from grace_legacy.backends.horovod import HorovodBackend


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    hvd.init()
    backend = HorovodBackend()
    began = time.monotonic()
    backend.open_board()
    opened_s = time.monotonic() - began
    backend.board.beat("board check")
    hvd.allreduce(torch.zeros(1), name="every beat posted")
    beats = backend.board.read()
    report = {"host": socket.gethostname(), "addresses": interface_addresses(), "opened_s": opened_s,
              "unreachable": backend.board.unreachable, "beats": beats}
    (args.out / f"rank{hvd.rank()}.json").write_text(json.dumps(report))
    hvd.allreduce(torch.zeros(1), name="every report written")


if __name__ == "__main__":
    main()
