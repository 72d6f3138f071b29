"""`python -m fthsdp.deploy.probe`: container health checks with the standard library alone.

The service images are slim (no curl, no wget), so their HEALTHCHECK and the compose health checks
run this module instead:

    python -m fthsdp.deploy.probe http://127.0.0.1:7451/livez          # 2xx → exit 0, else 1
    python -m fthsdp.deploy.probe --fresh /data/run/replicas/r0.jsonl --max-age-s 300

`--fresh` passes while a file was modified recently: a replica's leader appends a line per
committed step, so a stale file means the replica stopped making progress (a hang), which an
alive-but-stuck process would never report by itself. A missing file passes during the start
period only, which the orchestrator's `start_period` bounds.

It imports nothing outside the standard library, so it runs in every image."""

from __future__ import annotations

import argparse
import http.client
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path


def http_ok(url: str, timeout_s: float) -> tuple[bool, str]:
    """Whether GET `url` answers 2xx within `timeout_s`; the reason either way."""
    if not url.startswith(("http://", "https://")):
        return False, f"not an http(s) URL: {url!r}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (scheme checked)
            status = int(response.status)
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"{url}: {exc}"
    except http.client.HTTPException as exc:  # something else holds the port: not ready either
        return False, f"{url}: not an HTTP answer ({type(exc).__name__})"
    return 200 <= status < 300, f"{url}: HTTP {status}"


def file_fresh(path: Path, max_age_s: float, now: float | None = None) -> tuple[bool, str]:
    """Whether `path` was modified less than `max_age_s` ago (a missing file fails)."""
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except FileNotFoundError:
        return False, f"{path}: missing"
    return age < max_age_s, f"{path}: modified {age:.0f} s ago (limit {max_age_s:.0f} s)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fthsdp.deploy.probe", description=__doc__)
    parser.add_argument("url", nargs="?", help="HTTP URL that must answer 2xx")
    parser.add_argument("--fresh", type=Path, help="file that must have been modified recently")
    parser.add_argument(
        "--max-age-s", type=float, default=300.0, help="how recent --fresh must be (default 300)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=3.0, help="HTTP timeout in seconds (default 3)"
    )
    args = parser.parse_args(argv)
    if (args.url is None) == (args.fresh is None):
        parser.error("give exactly one of URL or --fresh PATH")
    if args.url is not None:
        ok, reason = http_ok(args.url, args.timeout_s)
    else:
        ok, reason = file_fresh(args.fresh, args.max_age_s)
    print(("ok: " if ok else "failing: ") + reason)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
