"""The ``planner`` section of the cluster config: the SLA planner sizes the pools itself.

Off by default: the pools keep the sizes of ``prefill.replicas`` and ``decode.replicas``
(and whatever ``baton scale`` sets). On, the router process runs the planner's loop
(``cluster/planner_loop.py``, docs/planner.md) every ``interval_seconds``.
"""

from __future__ import annotations

from pydantic import field_validator, model_validator

from cluster.config_schema import ConfigSection, option
from cluster.planner.policy import PlannerConfig
from cluster.planner.profile import load_profile
from cluster.planner.simulator import PoolLimits


class PlannerSection(ConfigSection):
    enabled: bool = option(
        False,
        "Size the prefill and decode pools to the SLA below (docs/planner.md); off: the "
        "pools keep their configured sizes (and baton scale's)",
    )
    interval_seconds: float = option(
        10.0, "Seconds between two decisions (the observation window's length)", gt=0.0
    )
    ttft_p90_ms: float = option(1000.0, "SLA: p90 time to first token, milliseconds", gt=0.0)
    itl_p90_ms: float = option(100.0, "SLA: p90 inter-token latency, milliseconds", gt=0.0)
    max_workers: int = option(4, "Most prefill + decode workers the planner may run together", ge=2)
    min_prefill: int = option(1, "Fewest prefill workers the planner keeps", ge=1)
    min_decode: int = option(1, "Fewest decode workers the planner keeps", ge=1)
    cooldown_seconds: float = option(
        60.0,
        "After a change (the planner's or a manual one), no scale-down for this long; "
        "at least the time a new worker takes to join",
        ge=0.0,
    )
    down_margin: float = option(
        0.8,
        "Scale down only when the smaller pool's predicted p90 is at most this share of "
        "the SLA (room against reversals)",
        gt=0.0,
        le=1.0,
    )
    down_windows: int = option(
        6,
        "Scale down only when the smaller pool fits with down_margin in each of this many "
        "last windows, each at its own planned rate (one quiet window shrinks nothing)",
        ge=1,
    )
    down_dwell_cooldowns: float = option(
        3.0,
        "After a scale-up, no scale-down for this many cooldown_seconds (a pool grown for a "
        "step is not shrunk by the first quiet windows after it)",
        ge=0.0,
    )
    down_hysteresis_sigmas: float = option(
        2.0,
        "Scale a pool down only when the forecast rate is this many Poisson standard "
        "deviations of a window below the forecast that grew it (no up-down pairs at a "
        "constant load near a pool's limit; 0: off)",
        ge=0.0,
    )
    headroom_sigmas: float = option(
        1.0,
        "Plan for the forecast rate plus this many standard deviations of the next "
        "window's rate (its Poisson spread, wider right after a step; 0: the rate alone)",
        ge=0.0,
    )
    step_sigmas: float = option(
        4.0,
        "A window whose arrivals lie this many Poisson standard deviations above the "
        "forecast is a step in load: the forecast restarts at its rate (sized at once)",
        gt=0.0,
    )
    mix_windows: int = option(
        3,
        "The predicted next window takes its prompt and output lengths from this many "
        "last windows' requests (after a step, the windows before it show the long prompts)",
        ge=1,
    )
    warmup_steps: int = option(
        20, "A new worker's first step records left out of the step-time fits", ge=0
    )
    spread_records: int = option(
        2048,
        "Recent step records whose spread around the fit the simulation replays (p90s "
        "are set by slow steps, not the mean); 0: the mean fit alone",
        ge=0,
    )

    profile: str | None = option(
        None,
        "A step-time profile from `baton profile` (JSON): the fits start from its records, "
        "so the planner decides from its first tick, and serving refines them; unset: "
        "learned online from the workers' first steps",
    )

    @field_validator("profile")
    @classmethod
    def _check_profile(cls, path: str | None) -> str | None:
        if path is not None:
            load_profile(path)  # ValueError naming the file and what is wrong with it
        return path

    @model_validator(mode="after")
    def _check_minimums(self) -> PlannerSection:
        if self.min_prefill + self.min_decode > self.max_workers:
            raise ValueError(
                f"max_workers: {self.max_workers} is below min_prefill + min_decode "
                f"({self.min_prefill + self.min_decode})"
            )
        return self

    def policy_config(self, limits: PoolLimits) -> PlannerConfig:
        """The decision core's settings (``limits``: the pools' engine settings)."""
        return PlannerConfig(
            ttft_p90_ms=self.ttft_p90_ms,
            itl_p90_ms=self.itl_p90_ms,
            max_workers=self.max_workers,
            min_prefill=self.min_prefill,
            min_decode=self.min_decode,
            cooldown_s=self.cooldown_seconds,
            down_margin=self.down_margin,
            down_windows=self.down_windows,
            down_dwell_cooldowns=self.down_dwell_cooldowns,
            down_hysteresis_sigmas=self.down_hysteresis_sigmas,
            headroom_sigmas=self.headroom_sigmas,
            step_sigmas=self.step_sigmas,
            mix_windows=self.mix_windows,
            limits=limits,
        )
