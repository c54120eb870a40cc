"""Print where the engine thread's time went in a serving.py result: per trace, per step kind, per host phase.

    python benchmarks/summarize_serving.py results.json [more.json ...]
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    for path in sys.argv[1:]:
        report = json.load(open(path))
        print(f"{path}: {report['device']} jax {report['jax_version']} commit {report['git_commit'][:10]} "
              f"pool {(report['engine'].get('pool_bytes') or 0) / 2**30:.0f} GiB, warm-up {report['warmup_s']:.0f} s, "
              f"{report['compiles_after_warmup']} compiles after it")
        for r in report["results"]:
            print(f"  {r['trace']:24s} {r['throughput_req_s']:6.2f} req/s {r['throughput_tok_s']:6.0f} tok/s "
                  f"{r['elapsed_s']:5.1f} s  decode {r.get('decode_step_ms_median', float('nan')):.1f} ms "
                  f"(x{r.get('decode_over_roofline', float('nan')):.2f})  store {r.get('store')}")
            for kind in ("prefill", "decode"):
                host = r.get(f"{kind}_host_s")
                if host:
                    print(f"    {kind:7s} {r[f'{kind}_steps']:5d} steps, host s: "
                          + ", ".join(f"{k} {v:.2f}" for k, v in host.items()))


if __name__ == "__main__":
    main()
