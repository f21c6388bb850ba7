"""The POPGym results of examples/popgym_ppo.py as one table: runs made in several processes
or on several machines (each with its own --out folder) merged into one returns.json, a
learning-curve PNG a task (popgym_ppo.py's plot), and a Markdown table a row a task and core:

    python examples/popgym_table.py runs/a runs/b --out popgym [--grid popgym/all.png]

A run's final return is the mean of its last 10 updates' returns (one update's episodes are
few and noisy); the table gives its mean over the seeds, with the lowest and highest seed,
and the wall time an update (median over the run's updates, then over the seeds).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from popgym_ppo import CORES, plot  # (this script's folder is on the path when it runs)

LAST = 10  # updates averaged into a run's final return


def merge(folders: list[Path]) -> dict:
    """{task: {core: {seed: run}}} from every folder's returns.json (the first of a run found
    twice; found twice with other returns, an error)."""
    merged: dict = {}
    for folder in folders:
        path = folder / "returns.json"
        if not path.is_file():
            sys.exit(f"popgym_table.py: error: {path} does not exist")
        for task, cores in json.loads(path.read_text()).items():
            for core, seeds in cores.items():
                for seed, run in seeds.items():
                    runs = merged.setdefault(task, {}).setdefault(core, {})
                    # (a rerun of a run is the same run: the CPU runs are deterministic, only
                    # their wall times differ)
                    if seed in runs and (runs[seed]["steps"], runs[seed]["returns"]) != (run["steps"], run["returns"]):
                        sys.exit(f"popgym_table.py: error: {task} {core} seed {seed} is in two folders, "
                                 f"with different returns ({path})")
                    runs.setdefault(seed, run)
    return merged


def final_return(run: dict) -> float:
    """The mean return of a run's last LAST updates that ended an episode (nan if none did)."""
    ended = [r for r in run["returns"][-LAST:] if r is not None]
    return float(np.mean(ended)) if ended else float("nan")


def shown_return(value: float) -> str:
    return "-" if np.isnan(value) else f"{value:+.3f}"


def table(results: dict, cores_order: list[str]) -> str:
    lines = ["| task | core | seeds | final return, mean (lowest / highest seed) | updates | s an update |",
             "|---|---|---|---|---|---|"]
    for task in sorted(results):
        cores = results[task]
        finals = {core: [final_return(r) for r in seeds.values()] for core, seeds in cores.items()}
        # (a run that ended no episode in its last updates has no final return: "-", left out of the mean)
        means = {core: float(np.nanmean(f)) if not np.isnan(f).all() else float("nan") for core, f in finals.items()}
        best = max((m for m in means.values() if not np.isnan(m)), default=None)
        for core in sorted(cores, key=lambda c: cores_order.index(c) if c in cores_order else len(cores_order)):
            runs = list(cores[core].values())
            mean = means[core]
            shown = f"{shown_return(mean)}" + (f" ({shown_return(np.nanmin(finals[core]))} / "
                                               f"{shown_return(np.nanmax(finals[core]))})"
                                               if len(runs) > 1 and not np.isnan(mean) else "")
            if mean == best:
                shown = f"**{shown}**"
            seconds = np.median([np.median(r["seconds"]) for r in runs])
            updates = sorted({len(r["returns"]) for r in runs})
            lines.append(f"| {task} | {core} | {len(runs)} | {shown} | {'/'.join(map(str, updates))} | {seconds:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path, help="popgym_ppo.py --out folders")
    ap.add_argument("--out", type=Path, required=True, help="where the merged returns.json and the PNGs go")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--grid", type=Path, help="also every task's curves in one PNG, a panel a task")
    args = ap.parse_args()
    results = merge(args.folders)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "returns.json").write_text(json.dumps(results))
    if not args.no_plots:
        for task, cores in results.items():
            plot({task: cores}, args.out / f"{task}.png")
    if args.grid:
        plot(results, args.grid, cols=2, dpi=72)
    print(table(results, CORES))


if __name__ == "__main__":
    main()
