"""Discovery's autograd graphs: the nodes of the history a tensor holds, counted incrementally.

A plain torch.Tensor met in the walk that carries autograd history is followed: its graph's
nodes are counted by torch's sequence numbers, anew where the graph is new, else the nodes added
since the last pass, so that a graph that grows step after step is found at a bounded cost.
torch is never imported here: only a program that imported it has tensors to follow.
"""

from __future__ import annotations

from typing import Any

#: Autograd graph nodes counted per tensor and pass at most (the first pass: GRAPH_FIRST_BUDGET).
GRAPH_BUDGET = 1024
GRAPH_FIRST_BUDGET = 4096
#: Graph tensors followed at most (names: a root's sequence number and a count each).
MAX_GRAPHS = 256
# AccumulateGrad, a parameter's leaf node, has the largest sequence number (it runs first).
_LEAF_SEQUENCE = 1 << 62


def _graph_nodes(root: Any, floor: int, budget: int) -> tuple[int, bool]:
    """The nodes of the autograd graph under `root` numbered above `floor` (every node: -1), at
    most `budget` of them counted; and whether a node numbered `floor` is among their children,
    that is whether this graph extends the one whose root was numbered `floor`. Parameters' leaf
    nodes (AccumulateGrad) are not counted. Each node is asked for its sequence number and its
    next functions, nothing else."""
    count, extends = 0, False
    stack = [root]
    seen = {id(root)}
    met: list[Any] = []
    try:
        while stack and count < budget:
            node = stack.pop()
            count += 1
            # The first input first: `total += loss` keeps the history in its first, so the
            # node numbered `floor` is met within a few nodes, whatever the size of a step's.
            for child, _ in reversed(node.next_functions):
                if child is None or id(child) in seen:
                    continue
                seen.add(id(child))
                met.append(child)  # alive till the count is done: no id is reused meanwhile
                number = child._sequence_nr()
                if number >= _LEAF_SEQUENCE:
                    continue
                if number <= floor:
                    extends = extends or number == floor
                    continue
                stack.append(child)
    except Exception:
        pass
    return count, extends


def graph(graphs: dict[str, tuple[int, int, int]], pass_number: int, name: str,
          grad_fn: Any) -> tuple[int, int]:
    """The nodes of the autograd history a tensor holds (-1: none), and the nodes looked
    at: counted anew where its graph is new, else the nodes added since the last pass
    (those numbered above the root then) added to the count then. `graphs` is the scanner's
    table of the graphs met (name -> root's number, nodes, pass last met in), `pass_number`
    the pass under way."""
    if grad_fn is None:
        return -1, 1  # no history: nothing to follow
    try:
        root = grad_fn._sequence_nr()
    except Exception:
        return -1, 1
    known = graphs.get(name)
    if known is not None and known[0] == root:
        graphs[name] = (root, known[1], pass_number)
        return known[1], 1
    if known is not None and known[0] < root:
        added, extends = _graph_nodes(grad_fn, known[0], GRAPH_BUDGET)
        total = known[1] + added if extends else added
    else:
        added, _ = _graph_nodes(grad_fn, -1, GRAPH_FIRST_BUDGET)
        total = added
    if known is None and len(graphs) >= MAX_GRAPHS:
        # The ones met longest ago go.
        for old in sorted(graphs, key=lambda k: graphs[k][2])[:MAX_GRAPHS // 4]:
            del graphs[old]
    graphs[name] = (root, total, pass_number)
    return total, added
