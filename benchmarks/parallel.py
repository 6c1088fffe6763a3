"""Run benchmark points in worker processes with a progress bar, results in job order."""
from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Callable, Sequence, TypeVar

J = TypeVar("J")


def run_points(fn: Callable[[J], dict], jobs: Sequence[J], workers: int, desc: str,
               label: Callable[[J], str] = str, first: Callable[[J], object] | None = None) -> list[dict]:
    """fn(job) for every job in `workers` processes (1: in this one); `first` sorts the
    submission order (slow points first keeps the workers busy to the end)."""
    from tqdm import tqdm

    order = sorted(range(len(jobs)), key=lambda i: first(jobs[i])) if first else list(range(len(jobs)))
    rows: list[dict] = [{}] * len(jobs)
    with tqdm(total=len(jobs), desc=desc, unit="point") as bar:
        if workers <= 1:
            for i in order:
                rows[i] = fn(jobs[i])
                bar.set_postfix_str(label(jobs[i]))
                bar.update()
            return rows
        with ProcessPoolExecutor(workers) as pool:
            futures = {pool.submit(fn, jobs[i]): i for i in order}
            for fut in as_completed(futures):
                i = futures[fut]
                rows[i] = fut.result()
                bar.set_postfix_str(label(jobs[i]))
                bar.update()
    return rows
