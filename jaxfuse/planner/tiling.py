"""Tiling expressions (MCFuser III-A/B): loop structure and statement placement.

``mhnk`` is a deep tiling (each loop nested in the previous); ``mn(k,h)`` a
flat one (``k`` and ``h`` run one after the other inside ``n``); placed
statements print as ``mh(n(k(La,Lb,Cc),Ld,Ce),Se)``.
"""

from __future__ import annotations

import dataclasses
from typing import Union


@dataclasses.dataclass(frozen=True)
class Stmt:
  """A Load ('L'), Compute ('C') or Store ('S') of the named IR value."""
  kind: str
  value: str

  def __post_init__(self):
    if self.kind not in ("L", "C", "S"):
      raise ValueError(f"statement kind must be L, C or S, got {self.kind!r}")

  def __str__(self) -> str:
    return f"{self.kind}{self.value}"


@dataclasses.dataclass(frozen=True)
class LoopNode:
  """A sequential loop over tiles of ``loop``; ``body`` runs in order."""
  loop: str
  body: tuple["Node", ...] = ()


Node = Union[LoopNode, Stmt]


def _fmt_body(body: tuple[Node, ...], sep: str) -> str:
  if len(body) == 1 and isinstance(body[0], LoopNode):
    return _fmt_node(body[0], sep)
  return "(" + ",".join(_fmt_node(n, sep) for n in body) + ")"


def _fmt_node(node: Node, sep: str) -> str:
  if isinstance(node, Stmt):
    return str(node)
  if not node.body:
    return node.loop
  return node.loop + sep + _fmt_body(node.body, sep)


@dataclasses.dataclass(frozen=True)
class TilingExpr:
  """A scope of nodes (the per-program body, or a whole expression)."""
  body: tuple[Node, ...] = ()

  def __str__(self) -> str:
    multi = any(len(l) > 1 for l in self.loops())
    sep = "." if multi else ""
    if len(self.body) == 1:
      return _fmt_node(self.body[0], sep)
    if not self.body:
      return "()"
    return "(" + ",".join(_fmt_node(n, sep) for n in self.body) + ")"

  def loops(self) -> list[str]:
    """Loop names in pre-order."""
    out: list[str] = []

    def walk(nodes):
      for n in nodes:
        if isinstance(n, LoopNode):
          out.append(n.loop)
          walk(n.body)
    walk(self.body)
    return out
