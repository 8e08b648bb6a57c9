"""The modes (docs/architecture.md, The modes): how a run stores the C4 records of its CSA
layers and attends on them.

| mode   | C4 storage              | decode                                                   |
|--------|-------------------------|----------------------------------------------------------|
| native | native 584-byte records | stock attention                                          |
| triton | packed, R + 72 bytes    | reconstruct the selected native records, then stock      |
| kernel | packed, R + 72 bytes    | direct packed attention: reads only the kept coordinates |

A mode travels by its name (mode.name in configs and run.json, ServerSpec.mode, the
engine's --mode, the SGLang plugin's REMNANT_MODE); code that asks something of a mode
looks the name up with `mode_of` and asks the Mode, so a mode's rules live here alone.
Plain Python: config validation imports this module without torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from remnant.config_errors import ConfigError
from remnant.kv.formats import KERNEL_RETENTION, NATIVE_RECORD_BYTES, RETENTION_VALUES, packed_record_bytes


@dataclass(frozen=True)
class Mode:
    """What one mode does with C4 records; the answers every consumer asks of a mode name."""

    name: str
    #: C4 records are stored packed (R + 72 bytes), keeping `retentions`' coordinates;
    #: False: native 584-byte records.
    packed: bool
    #: Decode attends on the packed records directly, reading only the kept coordinates. A
    #: packed mode without it reconstructs the selected native records for stock attention.
    direct_decode: bool
    #: The retentions R (coordinates kept of 512) the mode serves; empty: it keeps none,
    #: ignores the config's retention and records none.
    retentions: tuple[int, ...]

    @property
    def keeps_retention(self) -> bool:
        return bool(self.retentions)

    @property
    def reconstructs(self) -> bool:
        """Decode rebuilds native records from packed ones before stock attention."""
        return self.packed and not self.direct_decode

    def record_bytes(self, retention: int) -> int:
        """Bytes of one stored C4 record at `retention` (which native ignores)."""
        return packed_record_bytes(retention) if self.packed else NATIVE_RECORD_BYTES

    def check_retention(self, values: Iterable[int]) -> None:
        """ConfigError naming the first R of `values` (one per CSA layer, or one uniform R)
        that this mode does not serve. Only for a mode that keeps a retention."""
        for value in values:
            if value not in self.retentions:
                allowed = ", ".join(map(str, self.retentions))
                raise ConfigError(f"retention={value} is not allowed with mode={self.name}; "
                                  f"{self.name} supports retention={allowed}")


NATIVE = Mode("native", packed=False, direct_decode=False, retentions=())
TRITON = Mode("triton", packed=True, direct_decode=False, retentions=RETENTION_VALUES)
KERNEL = Mode("kernel", packed=True, direct_decode=True, retentions=(KERNEL_RETENTION,))

_MODES = {mode.name: mode for mode in (NATIVE, TRITON, KERNEL)}
#: Every mode's name, in the order users see them listed.
MODE_NAMES = tuple(_MODES)


def mode_of(name: str, field: str = "mode") -> Mode:
    """The Mode called `name`; ConfigError (a ValueError) names `field`, the value and the
    modes there are."""
    mode = _MODES.get(name) if isinstance(name, str) else None
    if mode is None:
        raise ConfigError(f"{field}={name} is not a mode; allowed: {', '.join(MODE_NAMES)}")
    return mode


def check_packed_rules(mode: str, values: list[int], hicache: bool, name: str) -> None:
    """The packed modes' rules, shared by run configs (remnant.config.validate) and the
    SGLang plugin: each mode serves its own retentions (kernel: R=256 only); any layer with
    R != 256 requires HiCache off.

    mode: a packed mode's name; values: R per CSA layer (or one uniform R); name: how the
    retention is called in errors.
    """
    mode_of(mode).check_retention(values)
    if hicache and any(v != KERNEL_RETENTION for v in values):
        raise ConfigError(
            f"hicache=true is not allowed with retention={name}; "
            f"retention other than {KERNEL_RETENTION} requires hicache=false"
        )
