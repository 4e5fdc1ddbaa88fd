"""What the GPU tests of ``GraphWorkList`` replays share: one decode step captured in a CUDA graph
and replayed over each step's lengths, the outputs NaN-poisoned before every replay, each step's
result checked and kept (the tests compare a repeated step's bits)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def replay_steps(step: Callable[[], object], work, lens: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 steps: Sequence[Sequence[int]], check: Callable[[torch.Tensor], None]
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``step`` (a decode call writing ``out`` / ``lse`` with ``work``'s tensors and ``lens``) run
    once eagerly, captured, then replayed for each of ``steps`` after ``lens`` and ``work`` are
    rewritten with its lengths; ``check(host lengths)`` runs after each replay."""
    step()  # the first call of the signature (its checks, tensor maps and launch plan) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    results = []
    for seqlens in steps:
        host = torch.tensor(seqlens, dtype=torch.int32)
        lens.copy_(host)
        work.update(host)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(host)
        results.append((out.clone(), lse.clone()))
    return results
