// The list scheduler behind the zero-bubble generators (generators.cpp).
//
// [Note: list scheduling at costs] The zero-bubble schedules "zbh1", "interleaved_zb" and "zbv"
// are list-scheduled: every rank that is free at a time runs the first action its rule allows
// with the inputs that exist by then, ranks in order at equal times. Times come from per-stage
// costs of F, B and W (Costs; unit costs when a list is empty, which gives the published orders,
// checked against stored tables). Real costs are uneven, and the order matters: the first stage
// computes no input gradient, so its B is nearly free and its W is its whole backward, and a
// rank that waits on a slower neighbour should fill the wait with work that fits. Measured
// compiled costs on 2 ranks (benchmarks/schedules.py) give a ZB-H1 order that the simulator puts
// 5% ahead of 1F1B, where the unit-cost order ties with it. A rule only ever picks an action
// whose inputs exist at that time, so every order is deadlock-free (the validator checks again).
// List scheduling is a heuristic, and at some costs the published order is the better one
// (measured: interleaved_zb on 2 ranks): make_schedule keeps the published order unless the
// simulator puts the one for the costs strictly ahead of it at those costs.
#pragma once

#include <cstdint>
#include <vector>

#include "schedule/schedule.h"
#include "schedule/simulator.h"

namespace pippy_xla {

// Per rank, its compute actions in order.
using Orders = std::vector<std::vector<Action>>;

// Zero-bubble ZB-H1 on `p` ranks with `m` microbatches, one stage per rank: each free rank runs,
// in this priority, the oldest backward (input gradients) whose gradient is there, else the next
// forward whose input is there while fewer than `p - r` microbatches await their backward
// (1F1B's bound) and at most `p` hold a graph (await W), else the oldest pending weight-gradient
// step. Weight steps fill the time a rank would otherwise wait: at unit costs, for up to 4 ranks
// the bubble drops from 1F1B's (p-1)(F+B+W) to ZB-H1's (p-1)(F+B-W), a third (more ranks: about
// 0.4), with every rank holding at most p+1 microbatches' graphs (1F1B: p - r).
Orders zero_bubble_h1(int32_t p, int32_t m, const Costs& costs);

// [Note: greedy schedules] List scheduling for several stages per rank with a split backward:
// each free rank runs the first backward of its `b_order` whose forward ran here and whose
// gradient is there, else the first forward of its `f_order` whose input is there while it holds
// fewer than `max_held[r]` microbatch-stages (forwarded and not yet weighted: their activations),
// else its oldest pending weight step. The orders say which of several ready actions goes first
// (for a V, the deeper chunk: the microbatch nearer its loss); the bound is the schedule's
// activation memory. At uneven costs a rank can fill its bound with forwards of a shallower stage
// while every slot waits on a gradient that needs a deeper stage's forward first (never at unit
// costs); then the rule runs again with one slot of the bound kept for each deeper stage.
Orders greedy(const Schedule& s, const Orders& f_order, const Orders& b_order,
              const std::vector<int32_t>& max_held, const Costs& costs);

}  // namespace pippy_xla
