"""The ``kvtier`` command. Each sub-command lives in its own module and is registered here."""

from __future__ import annotations

import time

STARTED = time.monotonic()  # kvtier replay's wall time where /proc cannot say when the process started

import click  # noqa: E402

from kvtier import __version__  # noqa: E402
from kvtier.cli.bench import bench  # noqa: E402
from kvtier.cli.plan import plan  # noqa: E402
from kvtier.cli.pools import pools  # noqa: E402
from kvtier.cli.replay import replay  # noqa: E402
from kvtier.cli.serve import serve  # noqa: E402
from kvtier.cli.status import status  # noqa: E402
from kvtier.cli.tier_options import add_tier_options  # noqa: E402


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="kvtier")
def main() -> None:
    """kvtier: KV-cache tiering for DeepSeek-sparse-attention models.

    Skip-aware device pools (no indexer key cache for skip-topk layers), a host-memory tier and an
    LMDB disk tier, served over gRPC.
    """


main.add_command(plan)
main.add_command(add_tier_options(serve))
main.add_command(status)
main.add_command(pools)
main.add_command(replay)
main.add_command(bench)
