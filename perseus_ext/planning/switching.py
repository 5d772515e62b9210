"""Latency-aware clean-up of plans: drop clock changes that cost more than they save.

With a switch latency L (see `energy.py`), a computation that starts within L of its stage
predecessor's end runs part of its work at the predecessor's clock. A change to a slower clock
then mostly runs fast (energy spent for nothing), and a change to a faster clock runs slow at
first (time lost). `merge_switches` moves a computation onto its neighbour's clock wherever the
latency-aware replay says the plan gets cheaper without missing its deadline.

A change whose modelled saving is only a few joules is not worth making: while its ramp runs,
the computation it lands on is not at its planned clock, and a change landing a little early or
late costs about as much as it saves. With a switch cost c, `merge_switches` counts every change
as c joules, and `thinning.with_fewer_switches` thins a whole frontier that way (the plans still report
their exact replayed energy, not the cost).
"""

from __future__ import annotations

import numpy as np

from perseus_ext.planning.dag import NO_NODE
from perseus_ext.planning.energy import CostModel

_EPS = 1e-9


def _with_clock(
    model: CostModel, node: np.ndarray, option: np.ndarray, start: np.ndarray,
    prev_end: np.ndarray, carried: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(duration, energy) of `node` at `option`, starting at `start` with the clock of option
    `carried` in force until `prev_end` + L (the latency-aware formula, element-wise)."""
    own_t, own_e = model.times[node, option], model.energies[node, option]
    old_t, old_e = model.times[node, carried], model.energies[node, carried]
    tau = np.clip(prev_end + model.switch_latency_s - start, 0.0, old_t)
    part = np.where(carried != option, tau / old_t, 0.0)
    duration = np.where(carried != option, tau + (1.0 - part) * own_t, own_t)
    return duration, own_e + part * (old_e - own_e)


def count_switches(model: CostModel, choice: np.ndarray) -> np.ndarray:
    """Clock changes between consecutive computations of a stage, per plan (column)."""
    choice = np.asarray(choice)
    columns = choice.reshape(len(choice), -1)
    node = np.flatnonzero(model.dag.stage_prev >= 0)
    prev = model.dag.stage_prev[node]
    own = np.take_along_axis(model.frequencies[node], columns[node], axis=1)
    before = np.take_along_axis(model.frequencies[prev], columns[prev], axis=1)
    changes = (own != before).sum(axis=0)
    return changes if choice.ndim > 1 else changes[0]


def _move_effects(
    model: CostModel, choice: np.ndarray, trace, slack: np.ndarray, node: np.ndarray,
    plan: np.ndarray, option: np.ndarray, switch_cost_j: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Estimated (cost saving, feasible) of putting `node` at `option` in `plan`; a move
    removes the change before `node`, worth `switch_cost_j`.

    Starts stay put except the stage successor's (pushed by the moved node's new end); the
    exact replay in `merge_switches` has the last word.
    """
    dag, power = model.dag, model.blocking_power
    finish, durations = trace.finish, trace.durations
    start = finish[node, plan] - durations[node, plan]
    prev = dag.stage_prev[node]
    prev_end = np.where(prev >= 0, finish[prev, plan], 0.0)
    new_d, new_e = _with_clock(model, node, option, start, prev_end, trace.carried[node, plan])
    new_end = start + new_d
    saving = trace.node_energies[node, plan] - new_e - power * (durations[node, plan] - new_d)
    feasible = new_end <= finish[node, plan] + slack[node, plan] + _EPS
    nxt = dag.stage_next[node]
    has_next = nxt >= 0
    nxt_safe = np.where(has_next, nxt, 0)
    # The successor's start: its other predecessors' ends, or the moved node's new end (one
    # dependency on the moved node is the stage order; a second one, a data dependency that
    # coincides with it, still counts the node's old end, as the estimate always has).
    preds = dag.pred_matrix[nxt_safe]
    if preds.shape[-1] == 2:  # at most two dependencies per node (1F1B, interleaved)
        other = np.where(preds[..., 0] == node, preds[..., 1], preds[..., 0])
        other_end = np.where(other != NO_NODE, finish[np.maximum(other, 0), plan], 0.0)
    else:
        is_node = preds == np.asarray(node)[..., None]
        first = is_node & (np.cumsum(is_node, axis=-1) == 1)
        others = np.where(first, NO_NODE, preds)
        other_end = np.where(
            others != NO_NODE, finish[np.maximum(others, 0), np.asarray(plan)[..., None]], 0.0
        ).max(axis=-1)
    nxt_start = np.maximum(new_end, other_end)
    nxt_carried = model.carry_from_prev[nxt_safe, option]
    nxt_d, nxt_e = _with_clock(model, nxt_safe, choice[nxt_safe, plan], nxt_start, new_end, nxt_carried)
    nxt_saving = (
        trace.node_energies[nxt_safe, plan] - nxt_e - power * (durations[nxt_safe, plan] - nxt_d)
    )
    nxt_feasible = nxt_start + nxt_d <= finish[nxt_safe, plan] + slack[nxt_safe, plan] + _EPS
    saving = saving + np.where(has_next, nxt_saving, 0.0) + switch_cost_j
    feasible &= ~has_next | nxt_feasible
    return saving, feasible


def merge_switches(
    model: CostModel, choice: np.ndarray, deadlines: np.ndarray, rounds: int = 6,
    switch_cost_j: float = 0.0,
) -> np.ndarray:
    """Plans (columns of `choice`) with clock changes merged away where that saves energy
    (energy plus `switch_cost_j` per clock change, with a switch cost).

    Each round looks, in every plan at once, at the computations on one parity of stage
    positions that pay a switch penalty, and tries both merges: the computation takes its
    predecessor's clock, or the predecessor takes its clock. All moves estimated to save energy
    within their slack are applied together; if the exact latency-aware replay rejects the
    batch (late or not cheaper), the best quarter, then the single best move is tried. A
    plan's result is never later than its deadline nor costlier than its input.
    """
    choice = np.array(choice, dtype=np.int64)
    if (model.switch_latency_s <= 0 and switch_cost_j <= 0) or not choice.size:
        return choice
    dag = model.dag
    positions = np.zeros(len(dag), dtype=np.int64)
    for pos in dag.stage_positions:
        positions[pos] = np.arange(len(pos))
    energy = _cost(model, choice, switch_cost_j)[1]
    active = np.arange(choice.shape[1])
    idle_rounds = np.zeros(choice.shape[1], dtype=np.int64)
    for round_index in range(rounds):
        if not active.size:
            break
        sub = choice[:, active]
        trace = model.latency_trace(sub)
        slack = dag.latest_finish_times(trace.durations, deadlines[active]) - trace.finish
        penalised = (trace.carried != sub) & (dag.stage_prev >= 0)[:, None]
        penalised &= (positions % 2 == round_index % 2)[:, None]
        node_a, plan_a = np.nonzero(penalised)  # move A: node takes its predecessor's clock
        option_a = trace.carried[node_a, plan_a]
        node_b = dag.stage_prev[node_a]  # move B: the predecessor takes the node's clock
        option_b = model.carry_from_next[node_b, sub[node_a, plan_a]]
        nodes = np.r_[node_a, node_b]
        plans = np.r_[plan_a, plan_a]
        options = np.r_[option_a, option_b]
        saving, feasible = _move_effects(model, sub, trace, slack, nodes, plans, options, switch_cost_j)
        good = feasible & (saving > _EPS)
        nodes, plans, options, saving = nodes[good], plans[good], options[good], saving[good]
        # One move per (node, plan): the larger saving wins; rank each plan's moves by saving.
        order = np.lexsort((-saving, nodes, plans))
        first = np.r_[True, (np.diff(plans[order]) != 0) | (np.diff(nodes[order]) != 0)]
        order = order[first[: order.size]]
        order = order[np.lexsort((-saving[order], plans[order]))]
        plan_of = plans[order]
        starts = np.searchsorted(plan_of, np.arange(active.size))
        rank = np.arange(order.size) - starts[plan_of]
        counts = np.bincount(plan_of, minlength=active.size)
        # Moves share slack along paths, so a whole batch can be late: retry the rejected
        # plans with only their best quarter of the moves, then with their best move alone.
        ok = np.zeros(active.size, dtype=bool)
        new_energy = energy[active].copy()
        limit = counts.copy()
        for _ in range(3):
            todo = np.flatnonzero(~ok & (limit > 0))
            if not todo.size:
                break
            pick = np.isin(plan_of, todo) & (rank < limit[plan_of])
            batch = sub[:, todo].copy()
            column = np.searchsorted(todo, plan_of[pick])
            batch[nodes[order[pick]], column] = options[order[pick]]
            accepted, energies = _accept(model, batch, deadlines[active[todo]], energy[active[todo]],
                                         switch_cost_j)
            sub[:, todo[accepted]] = batch[:, accepted]
            new_energy[todo[accepted]] = energies[accepted]
            ok[todo[accepted]] = True
            limit = np.where(limit > 1, np.maximum(limit // 4, 1), 0)
        choice[:, active[ok]] = sub[:, ok]
        energy[active[ok]] = new_energy[ok]
        idle_rounds[active] = np.where(ok, 0, idle_rounds[active] + 1)
        active = active[idle_rounds[active] < 2]  # both parities found nothing: done
    return choice


def repair_latency(
    model: CostModel, choice: np.ndarray, deadlines: np.ndarray, rounds: int = 16
) -> np.ndarray:
    """Plans (columns) planned without latency, sped up until the latency-aware replay meets
    their deadlines again (as far as `rounds` batched steps get).

    Latency makes a computation that follows a slower one on its stage start slow. Each round,
    in every late plan, every such computation on the critical path gets its predecessor moved
    onto its own clock; a late plan with none speeds up its critical computation of the
    cheapest extra effective energy per second by one clock, as `repair_deadline` does.
    """
    choice = np.array(choice, dtype=np.int64)
    if model.switch_latency_s <= 0 or not choice.size:
        return choice
    dag = model.dag
    with np.errstate(invalid="ignore"):
        cost = model.energies - model.blocking_power * model.times
        saved = np.c_[np.zeros(len(cost)), model.times[:, 1:] - model.times[:, :-1]]
        extra = np.c_[np.full(len(cost), np.inf), cost[:, :-1] - cost[:, 1:]]
    active = np.arange(choice.shape[1])
    for _ in range(rounds):
        trace = model.latency_trace(choice[:, active])
        still_late = trace.finish.max(axis=0) > deadlines[active] + _EPS
        active = active[still_late]
        if not active.size:
            break
        sub = choice[:, active]
        finish, durations = trace.finish[:, still_late], trace.durations[:, still_late]
        carried = trace.carried[:, still_late]
        slack = dag.latest_finish_times(durations, deadlines[active]) - finish
        critical = slack <= slack.min(axis=0) + _EPS
        slowed = critical & (carried > sub) & (dag.stage_prev >= 0)[:, None]
        node, plan = np.nonzero(slowed)
        prev = dag.stage_prev[node]
        faster = model.carry_from_next[prev, sub[node, plan]]
        move = faster < sub[prev, plan]
        sub[prev[move], plan[move]] = faster[move]
        stuck = np.ones(active.size, dtype=bool)
        stuck[plan[move]] = False
        rows = np.arange(len(sub))[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            price = np.where(critical & (sub > 0), extra[rows, sub] / saved[rows, sub], np.inf)
        pick = price.argmin(axis=0)
        can = stuck & np.isfinite(price[pick, np.arange(active.size)])
        sub[pick[can], np.flatnonzero(can)] -= 1
        choice[:, active] = sub
        active = active[~stuck | can]  # plans nothing could speed up stay late
    return choice


def _cost(model: CostModel, choice: np.ndarray, switch_cost_j: float) -> tuple[np.ndarray, np.ndarray]:
    """(times, energies plus `switch_cost_j` per clock change) of plans (columns)."""
    times, energies = model.replay(choice)
    if switch_cost_j > 0:
        energies = energies + switch_cost_j * count_switches(model, choice)
    return times, energies


def _accept(
    model: CostModel, candidates: np.ndarray, deadlines: np.ndarray, costs: np.ndarray,
    switch_cost_j: float,
) -> tuple[np.ndarray, np.ndarray]:
    """(mask of candidates that meet their deadline and cost less, their costs)."""
    if not candidates.shape[1]:
        return np.zeros(0, dtype=bool), np.zeros(0)
    times, new = _cost(model, candidates, switch_cost_j)
    return (times <= deadlines + _EPS) & (new < costs - 1e-9), new

