"""Merge per-family runs of ``benchmarks/train_llama.py`` into one record, one plot and docs/models.md's table.

    python benchmarks/families.py OUT.json IN.json [IN.json ...]

Each input is a ``train_llama.py`` result (``<stem>.json``) or a merged file of this script's own format, so
a family measured again replaces its earlier entry (the last input wins). A family's runs come from one
process tree on one GPU; families may come from different GPUs (the table names each row's) and commits (in
the json). Written: ``OUT.json`` (per family: the GPU, commit, versions, parameters and every run's status,
tokens/s, peak memory, graph breaks, loss differences to Hugging Face eager and losses), ``OUT.png`` (tokens/s
over Hugging Face eager's, and peak memory, per family and run), and the markdown table on stdout.
"""

from __future__ import annotations

import json
import os
import sys

RUNS = ("hf-eager", "tritongrad-eager", "liger-eager", "hf-compile", "tritongrad-compile")
KEEP = ("run", "status", "tokens_per_s", "peak_mem_gib", "graph_breaks", "first_loss_rel_diff_vs_hf_eager",
        "mean_rel_loss_diff_vs_hf_eager", "losses")


def families(paths: list[str]) -> dict[str, dict]:
    """Family name -> entry, from train_llama results and merged files; a later file replaces a family."""
    out: dict[str, dict] = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if "families" in data:
            for name, entry in data["families"].items():
                out[name] = {"git": data.get("git"), "versions": data.get("versions"),
                             "command": data.get("command"), "device": data.get("gpu"), **entry}
            continue
        s = data["settings"]
        extra = f" --experts {s['experts']} --top-k {s['top_k']}" if "moe" in s["family"] else ""
        out[s["family"]] = {
            "device": data["device"], "git": data["git"], "versions": data["versions"],
            "parameters": data["parameters"],
            "command": (f"python3 benchmarks/train_llama.py --family {s['family']}{extra} --size {s['size']} "
                        f"--seq {s['seq']} --batch {s['batch']} --steps {s['steps']} --warmup {s['warmup']} "
                        f"--runs {s['runs']} --time-limit {s['time_limit']:g}"),
            "runs": [{k: r.get(k) for k in KEEP} for r in data["runs"]],
        }
    return out


def table(fams: dict[str, dict]) -> str:
    """Markdown: tokens/s (x HF eager) and peak memory per run; '-' where a run did not finish."""
    head = ("| family | " + " | ".join(r.replace("-", " ") for r in RUNS)
            + " | tritongrad / HF, compiled | loss vs HF eager, first step / mean (rel., largest run) | GPU |")
    lines = [head, "|" + "---|" * (len(RUNS) + 4)]
    for name, entry in fams.items():
        runs = {r["run"]: r for r in entry["runs"]}
        base = (runs.get("hf-eager") or {}).get("tokens_per_s")
        cells, first, mean = [], [], []
        for key in RUNS:
            r = runs.get(key)
            if r is None or not r.get("tokens_per_s"):
                cells.append("-" if r is None else r.get("status", "-"))
                continue
            ratio = f" ({r['tokens_per_s'] / base:.2f}x)" if base and key != "hf-eager" else ""
            peak = f"{r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") is not None else "- GiB"  # CPU: none
            cells.append(f"{r['tokens_per_s'] / 1e3:.1f}k{ratio}, {peak}")
            first += [r["first_loss_rel_diff_vs_hf_eager"]] if r.get("first_loss_rel_diff_vs_hf_eager") is not None else []
            mean += [r["mean_rel_loss_diff_vs_hf_eager"]] if r.get("mean_rel_loss_diff_vs_hf_eager") is not None else []
        hc, tc = (runs.get(k, {}).get("tokens_per_s") for k in ("hf-compile", "tritongrad-compile"))
        compiled = f"{tc / hc:.2f}x" if hc and tc else "-"
        loss = " / ".join(f"{max(v):.1e}" if v else "-" for v in (first, mean))
        gpu = (entry.get("device") or "-").replace("NVIDIA ", "").split(" ")[0]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {compiled} | {loss} | {gpu} |")
    return "\n".join(lines)


def plot(fams: dict[str, dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(fams)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 1.3 * len(names)), 7), sharex=True)
    width = 0.8 / len(RUNS)
    for i, key in enumerate(RUNS):
        speed, mem = [], []
        for name in names:
            runs = {r["run"]: r for r in fams[name]["runs"]}
            base = (runs.get("hf-eager") or {}).get("tokens_per_s")
            r = runs.get(key) or {}
            ok = bool(r.get("tokens_per_s")) and bool(base)
            speed.append(r["tokens_per_s"] / base if ok else 0.0)
            mem.append(r.get("peak_mem_gib") or 0.0 if ok else 0.0)
        xs = [j + (i - len(RUNS) / 2 + 0.5) * width for j in range(len(names))]
        ax1.bar(xs, speed, width, label=key)
        ax2.bar(xs, mem, width, label=key)
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set_ylabel("tokens/s / HF eager")
    ax2.set_ylabel("peak memory (GiB)")
    ax2.set_xticks(range(len(names)), names, rotation=30)
    ax1.legend(ncol=len(RUNS), fontsize=7, loc="upper left")
    gpus = ", ".join(sorted({(fams[n].get("device") or "?").replace("NVIDIA ", "") for n in names}))
    ax1.set_title(f"bf16, ~350M, seq 2048, batch 4; {gpus} (a family's runs on one GPU; a missing bar: the run "
                  "did not finish)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    out, paths = argv[0], argv[1:]
    fams = families(paths)
    with open(out, "w") as f:
        json.dump({"what": "benchmarks/train_llama.py per family, merged by benchmarks/families.py; each "
                   "family's GPU and commit in its entry", "families": fams}, f, indent=1)
    plot(fams, os.path.splitext(out)[0] + ".png")
    print(table(fams))


if __name__ == "__main__":
    main(sys.argv[1:])
