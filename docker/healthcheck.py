"""The image's HEALTHCHECK: the peer's Prometheus endpoint answers and reports a round.

The node starts its metrics server once its model is built (after it has settled the run spec with the
swarm), so "healthy" means: up, in a swarm, training or about to. The port is $LOCOMM_METRICS_PORT
(the image sets 9100; docker-compose.yml passes the same to --metrics-port). Exit 0 healthy, 1 not.
"""

import os
import sys
import urllib.request


def main() -> int:
    port = os.environ.get("LOCOMM_METRICS_PORT", "9100")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=4) as r:
            body = r.read().decode("utf-8", "replace")
    except OSError as e:
        print(f"metrics on port {port} do not answer: {e}")
        return 1
    if "locomm_round{" not in body:
        print(f"metrics on port {port} answer without locomm_round")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
