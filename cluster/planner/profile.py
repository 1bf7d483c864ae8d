"""A step-time profile: the records ``baton profile`` measured, as a file the planner seeds
its fits with (``planner.profile``, docs/planner.md).

Why a file of records and not of coefficients: the planner's fits (``step_model.py``) are
least squares over records with forgetting, so seeding them with the measured records
gives the same fit ``baton profile`` would have computed, and lets the online records
outweigh it as they come (a profile measured on a quiet machine, or on another one, is
corrected by serving instead of fighting it). The records have the feed's meaning
(``cluster/planner_feed.py``): a prefill record is one prompt from arrival to its first
token (every chunk), with ``tokens`` the uncached prompt tokens and ``attention_work``
``tokens ** 2 / 1000``; a decode record is one step, with the sequences that got a token
and their context lengths summed.

JSON through msgspec typed structs: a file that is not a profile is refused naming the
field, and nothing in it is executed.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from cluster.planner.step_model import DecodeStep, PrefillStep

PROFILE_VERSION = 1
_SEED_ID = "profile"  # the worker id the seeded records carry (no warm-up applies)


class ProfiledPrefill(msgspec.Struct, forbid_unknown_fields=True):
    tokens: int
    attention_work: float
    seconds: float


class ProfiledDecode(msgspec.Struct, forbid_unknown_fields=True):
    batch: int
    kv_tokens: int
    seconds: float


class StepProfile(msgspec.Struct, forbid_unknown_fields=True):
    """What ``baton profile`` measured on one machine for one model and engine settings."""

    version: int
    model: str  # the served name
    device: str  # cpu | cuda
    threads: int  # torch threads on CPU (0: torch's default or a GPU)
    engine: dict[str, int | float | str | bool | None]  # the settings that shape a step
    created: str  # ISO 8601, UTC
    seconds: float  # how long the profile took
    prefill: list[ProfiledPrefill]
    decode: list[ProfiledDecode]

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ValueError(f"version {self.version} (this Baton reads {PROFILE_VERSION})")
        for name, records in (("prefill", self.prefill), ("decode", self.decode)):
            if len(records) < 8:
                raise ValueError(f"{name}: {len(records)} records (a fit needs at least 8)")
            if any(r.seconds <= 0 for r in records):
                raise ValueError(f"{name}: a record with seconds <= 0")

    def steps(self) -> list[PrefillStep | DecodeStep]:
        """The records as the step model takes them."""
        out: list[PrefillStep | DecodeStep] = [
            PrefillStep(_SEED_ID, r.seconds, r.tokens, r.attention_work) for r in self.prefill
        ]
        out += [DecodeStep(_SEED_ID, r.seconds, r.batch, r.kv_tokens) for r in self.decode]
        return out


def save_profile(profile: StepProfile, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(profile)) + b"\n")


def load_profile(path: str | Path) -> StepProfile:
    """Read a profile; ValueError naming the file and the problem."""
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=StepProfile)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the profile ({exc.strerror or exc})") from None
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise ValueError(f"{path}: not a step profile: {exc}") from None
