"""Which modules are stage-3 *units*, and which unit each parameter belongs to.

[Note: units]
A unit is a module whose parameters (minus those of units nested inside it) are gathered
together: one all-gather before it runs, one reduce-scatter after its backward. The root
module is always a unit (possibly owning no parameters). Further units are chosen by, in order
of precedence:

1. a policy ``policy(name, module) -> bool`` passed to ``zerodp.initialize(unit_policy=...)``;
2. ``ZeroConfig.stage3.unit_classes``: every module whose class name is listed (any size);
3. the default: every element of a container (``nn.ModuleList``, ``nn.Sequential``,
   ``nn.ModuleDict``) holding at least ``ZeroConfig.stage3.unit_min_numel`` parameter elements,
   and every *leaf* child of the root (a module without children, such as an ``nn.Embedding``
   or an ``nn.Linear`` LM head) owning at least ``ZeroConfig.stage3.leaf_unit_min_numel``
   parameter elements that no other module registers. These *attached* units keep the root unit
   small.

The default picks the repeated layers of a transformer (``blocks.0``, ``blocks.1``, ...) and,
in a large model, the token embedding and the LM head; position embeddings, final norms and
other small modules stay in the root unit. Models read root parameters directly (a tied LM head
is ``F.linear(x, self.wte.weight)`` in the root's forward, not a call of the embedding module),
so an attached unit is, for reading, part of the root: a read of one of its parameters while
the root is gathered (in the root's forward, or in the loss before backward) gathers it on
demand, and it then stays gathered as long as the root does (``hooks.py``). Otherwise it is
gathered only for its own module's forward and backward, and the root does not hold the
embedding and the head through the whole step. Units chosen by a policy or by
``unit_classes`` never gather on demand: reading their parameters elsewhere raises.

A parameter belongs to the innermost unit enclosing *every* module that registers it: a tied
parameter (registered by two modules) goes to their common enclosing unit, which is gathered
during both uses.

Reading rule: a parameter may be read only while its unit is gathered, i.e. inside the forward
of its unit's module (every forward nested in it included), during backward, or inside
``zerodp.full_parameters``. The root unit stays gathered from the root forward to the end of
backward, so root parameters may also be read in the loss. Reading a released parameter raises
a ``RuntimeError`` naming it (``access.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

UnitPolicy = Callable[[str, nn.Module], bool]
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True, eq=False)
class UnitSpec:
    """A unit before any tensor is touched."""

    index: int  # 0 is the root; then module pre-order
    name: str  # module path, "" for the root
    module: nn.Module
    parent: int | None  # the innermost enclosing unit (None for the root)
    attached: bool = False  # a default leaf unit of the root: gathered on demand when read

    @property
    def label(self) -> str:
        # zerodp.initialize renames the root's class to Zero<class>; show the user's name.
        return self.name or f"<root {type(self.module).__name__.removeprefix('Zero')}>"


@dataclass(frozen=True)
class UnitPlan:
    """The units of a model and where every module and parameter belongs."""

    units: tuple[UnitSpec, ...]
    param_unit: dict[int, int]  # id(parameter) -> unit index
    modules: tuple[tuple[nn.Module, ...], ...]  # per unit: modules it owns (pre-order)

    def ancestors(self, index: int) -> list[int]:
        out = []
        parent = self.units[index].parent
        while parent is not None:
            out.append(parent)
            parent = self.units[parent].parent
        return out


def plan_units(
    model: nn.Module,
    unit_classes: tuple[str, ...],
    min_numel: int,
    policy: UnitPolicy | None = None,
    leaf_min_numel: int | None = None,
) -> UnitPlan:
    """Choose the units of ``model`` (see [Note: units]). ``leaf_min_numel`` None: no attached
    leaf units."""
    units = [UnitSpec(0, "", model, None)]
    default = policy is None and not unit_classes
    own_numel = _own_numel(model) if default and leaf_min_numel is not None else {}
    module_unit: dict[int, int] = {id(model): 0}
    owned: list[list[nn.Module]] = [[model]]

    def is_unit(name: str, module: nn.Module, parent: nn.Module) -> bool:
        if policy is not None:
            return bool(policy(name, module))
        if unit_classes:
            return type(module).__name__ in unit_classes
        return isinstance(parent, CONTAINERS) and _numel(module) >= min_numel

    def is_attached(module: nn.Module, parent: nn.Module) -> bool:
        return (
            leaf_min_numel is not None
            and parent is model
            and not isinstance(module, CONTAINERS)
            and next(module.children(), None) is None
            and own_numel.get(id(module), 0) >= max(leaf_min_numel, 1)
        )

    def walk(module: nn.Module, prefix: str, unit: int) -> None:
        for child_name, child in module.named_children():
            if id(child) in module_unit:  # a module registered twice: visited once
                continue
            path = f"{prefix}.{child_name}" if prefix else child_name
            here = unit
            attached = default and is_attached(child, module)
            if attached or is_unit(path, child, module):
                here = len(units)
                units.append(UnitSpec(here, path, child, unit, attached))
                owned.append([])
            module_unit[id(child)] = here
            owned[here].append(child)
            walk(child, path, here)

    walk(model, "", 0)
    param_unit = _assign_params(model, units, module_unit)
    return UnitPlan(tuple(units), param_unit, tuple(tuple(m) for m in owned))


def _assign_params(
    model: nn.Module, units: list[UnitSpec], module_unit: dict[int, int]
) -> dict[int, int]:
    """Each parameter to the innermost unit enclosing every module that registers it."""
    owners: dict[int, list[int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module_unit[id(module)])
    return {pid: _common_unit(units, found) for pid, found in owners.items()}


def _common_unit(units: list[UnitSpec], found: list[int]) -> int:
    def chain(i: int) -> list[int]:
        out = [i]
        while units[out[-1]].parent is not None:
            parent = units[out[-1]].parent
            assert parent is not None
            out.append(parent)
        return out[::-1]  # root first

    common = chain(found[0])
    for other in found[1:]:
        path = chain(other)
        k = 0
        while k < min(len(common), len(path)) and common[k] == path[k]:
            k += 1
        common = common[:k]
    return common[-1]


def _own_numel(model: nn.Module) -> dict[int, int]:
    """id(module) -> elements of the parameters it registers that no other module registers."""
    registrars: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            registrars[id(p)] = registrars.get(id(p), 0) + 1
    return {
        id(module): sum(
            p.numel() for p in module.parameters(recurse=False) if registrars[id(p)] == 1
        )
        for module in model.modules()
    }


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
