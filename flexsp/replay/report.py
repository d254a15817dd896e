"""What a replay measured, per group, micro-batch and step, and how it prints. No torch.

A group's *replayed* time is its measured compute (the slowest replayed rank, forward + backward)
plus its modelled communication; its *predicted* time is the cost model's ``group_time``. A
micro-batch takes as long as its slowest group, a step as its micro-batches one after another:
the same makespan rule the planner uses, applied to both.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np


@dataclass(frozen=True)
class GroupReplay:
    micro_batch: int
    group: int
    degree: int
    first_rank: int
    sequences: int
    tokens: int
    replayed_ranks: tuple[int, ...]     # local ranks run on the device (the one with the most work, and
                                        # any whose work differs materially)
    samples: tuple[float, ...]          # timed repeats of the group's compute (slowest replayed rank)
    compute: float                      # measured compute, seconds (the report's statistic of samples)
    comm: float                         # modelled all-to-all seconds
    predicted: float                    # cost model group_time, seconds (its compute + comm + beta1)
    peak_memory_bytes: int | None = None  # device peak during the group (CUDA only)

    @property
    def replayed(self) -> float:
        return self.compute + self.comm

    @property
    def predicted_compute(self) -> float:
        return self.predicted - self.comm

    @property
    def compute_error(self) -> float:
        """(predicted - measured) / measured compute: positive when the cost model overestimates."""
        return (self.predicted_compute - self.compute) / self.compute if self.compute > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), replayed=self.replayed, predicted_compute=self.predicted_compute,
                    compute_error=self.compute_error)


@dataclass(frozen=True)
class ReplayReport:
    groups: tuple[GroupReplay, ...]
    num_micro_batches: int
    num_gpus: int
    strategy: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)

    def micro_batch(self, m: int) -> tuple[GroupReplay, ...]:
        return tuple(g for g in self.groups if g.micro_batch == m)

    @property
    def micro_batch_replayed(self) -> list[float]:
        return [max(g.replayed for g in self.micro_batch(m)) for m in range(self.num_micro_batches)]

    @property
    def micro_batch_predicted(self) -> list[float]:
        return [max(g.predicted for g in self.micro_batch(m)) for m in range(self.num_micro_batches)]

    @property
    def replayed_time(self) -> float:
        """Step makespan with measured compute and modelled communication."""
        return float(sum(self.micro_batch_replayed))

    @property
    def predicted_time(self) -> float:
        return float(sum(self.micro_batch_predicted))

    @property
    def step_error(self) -> float:
        return (self.predicted_time - self.replayed_time) / self.replayed_time

    @property
    def measured_share(self) -> float:
        """Share of the replayed makespan that is measured compute: on each micro-batch's slowest group (the
        critical path), its compute over its compute plus modelled communication."""
        critical = [max(self.micro_batch(m), key=lambda g: g.replayed) for m in range(self.num_micro_batches)]
        total = sum(g.replayed for g in critical)
        return sum(g.compute for g in critical) / total if total > 0 else float("nan")

    def compute_errors(self) -> tuple[float, float]:
        """Mean and max |relative error| of the cost model's per-group compute."""
        errors = np.abs([g.compute_error for g in self.groups])
        return float(np.mean(errors)), float(np.max(errors))

    def to_dict(self) -> dict[str, Any]:
        mean, worst = self.compute_errors()
        return {"strategy": self.strategy, "num_gpus": self.num_gpus, "meta": dict(self.meta),
                "step": {"replayed_time": self.replayed_time, "predicted_time": self.predicted_time,
                         "step_error": self.step_error, "group_compute_mean_abs_error": mean,
                         "group_compute_max_abs_error": worst, "measured_share": self.measured_share},
                "micro_batches": [{"micro_batch": m, "replayed_time": r, "predicted_time": p}
                                  for m, (r, p) in enumerate(zip(self.micro_batch_replayed, self.micro_batch_predicted))],
                "groups": [g.to_dict() for g in self.groups]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ReplayReport":
        names = GroupReplay.__dataclass_fields__
        groups = tuple(GroupReplay(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in g.items() if k in names})
                       for g in data["groups"])
        return cls(groups, len(data["micro_batches"]), data["num_gpus"], data.get("strategy", ""), data.get("meta", {}))

    def save(self, path: str | Path) -> Path:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return Path(path)


def format_groups(report: ReplayReport) -> str:
    """Markdown: one row per group, then one per micro-batch and the step."""
    lines = ["| micro-batch | group | degree | ranks | seqs | tokens | replayed ranks | measured compute (ms) | "
             "modelled comm (ms) | replayed (ms) | predicted (ms) | predicted compute error |",
             "|" + "---|" * 12]
    for g in report.groups:
        lines.append(f"| {g.micro_batch} | {g.group} | {g.degree} | {g.first_rank}-{g.first_rank + g.degree - 1} | "
                     f"{g.sequences} | {g.tokens} | {','.join(map(str, g.replayed_ranks))} | {g.compute * 1e3:.2f} | "
                     f"{g.comm * 1e3:.2f} | {g.replayed * 1e3:.2f} | {g.predicted * 1e3:.2f} | {g.compute_error:+.1%} |")
    lines += ["", "| micro-batch | replayed makespan (ms) | predicted makespan (ms) | predicted / replayed |",
              "|---|---|---|---|"]
    for m, (r, p) in enumerate(zip(report.micro_batch_replayed, report.micro_batch_predicted)):
        lines.append(f"| {m} | {r * 1e3:.2f} | {p * 1e3:.2f} | {p / r:.3f} |")
    lines.append(f"| **step** | **{report.replayed_time * 1e3:.2f}** | **{report.predicted_time * 1e3:.2f}** | "
                 f"**{report.predicted_time / report.replayed_time:.3f}** |")
    return "\n".join(lines)


def summary(report: ReplayReport) -> str:
    mean, worst = report.compute_errors()
    label = report.meta.get("label", "")
    return (f"{report.strategy or 'plan'}: {report.num_micro_batches} micro-batch(es), {len(report.groups)} groups on "
            f"{report.num_gpus} GPUs; step replayed {report.replayed_time:.4f} s vs predicted "
            f"{report.predicted_time:.4f} s ({report.step_error:+.1%}); per-group compute |error| mean {mean:.1%}, "
            f"max {worst:.1%}" + (f"\n{label}" if label else ""))
