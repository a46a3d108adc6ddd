"""The cost model's estimates of where drafting in a batch stops paying, for the bench's batch
mode (:mod:`specdec.decoders.evaluation.batching`): from a pipeline's drafts at the smallest
batch size run and the one-request T(n), the batch size at which drafting as much stops paying
(:func:`stop_estimate`) and the one at which any draft token does (:func:`any_stop_estimate`,
from the distribution of its likeliest first tokens' values, :func:`lead_quantiles`), in exact
mode within its widest pass; :func:`estimate_lines` says them under the batch table.
"""

from __future__ import annotations

from collections.abc import Sequence


def stop_estimate(
    accepted: float, drafted: float, curve, largest: int, widest: int | None = None
) -> int | None:
    """The cost model's batch size where drafting stops paying: the smallest B at which B
    requests each drafting ``drafted`` tokens and gaining ``accepted`` per pass (their figures
    alone) yield fewer tokens per second than B standard rows,
    (1 + accepted) / T(B (1 + drafted)) <= 1 / T(B), or no longer fit in exact mode's widest
    pass, B (1 + drafted) > ``widest`` (None: it pays up to ``largest``)."""
    for size in range(1, largest + 1):
        if widest is not None and size * (1 + drafted) > widest:
            return size
        if (1 + accepted) / curve(size * (1 + drafted)) <= 1 / curve(size):
            return size
    return None


def ranked_leads(quantiles: Sequence[float], size: int) -> list[float]:
    """The values of ``size`` requests' likeliest first tokens, best first, as drawn from the
    distribution whose evenly spaced quantiles (0 to 1) are ``quantiles``: the j-th best is
    its 1 - (j - 1/2) / size quantile."""
    points = len(quantiles) - 1
    ranked = []
    for j in range(1, size + 1):
        at = (1 - (j - 0.5) / size) * points
        low = min(int(at), points)
        high = min(low + 1, points)
        ranked.append(quantiles[low] + (quantiles[high] - quantiles[low]) * (at - low))
    return ranked


def lead_quantiles(values: Sequence[float], points: int = 20) -> list[float]:
    """``points`` + 1 evenly spaced quantiles (0 to 1) of ``values`` (empty: none)."""
    if not values:
        return []
    ordered = sorted(values)
    return [ordered[round(i * (len(ordered) - 1) / points)] for i in range(points + 1)]


def any_stop_estimate(
    leads: float | Sequence[float], curve, largest: int, widest: int | None = None
) -> int | None:
    """The cost model's batch size where no draft pays any more, so the sizer should draft
    nothing: the smallest B from which on, up to ``largest``, adding k rows to a pass of B,
    the k likeliest of the B requests' first draft tokens, yields fewer tokens per second for
    every k from 1 to B, (B + a_1 + ... + a_k) / T(B + k) <= B / T(B) (None: some k pays at
    ``largest``). From which on: T(n) rises in steps, so a size just past a step may not pay
    where larger ones do again; and every k, not only one row: a step's first row may not pay
    where its last rows do.

    ``leads``: the estimated acceptance of a request's likeliest first token, as quantiles
    of its distribution over the rounds alone (:func:`lead_quantiles`), so a_j is the j-th
    best of B draws: the joint choice takes the best requests' tokens first, and the more
    requests, the better the best of them. A single number: every request's alike (the
    share of rounds whose first token was accepted).

    ``widest``: exact mode's widest pass (:attr:`Target.widest_exact_pass`): a pass of B
    requests has room for ``widest`` - B draft rows, none from B = ``widest`` on."""
    last_paying = 0
    for size in range(1, largest + 1):
        room = size if widest is None else min(size, widest - size)
        if room < 1:
            break
        ranked = [float(leads)] * size if isinstance(leads, int | float) else ranked_leads(leads, size)
        gained = 0.0
        for k in range(1, room + 1):
            gained += ranked[k - 1]
            if (size + gained) / curve(size + k) > size / curve(size):
                last_paying = size
                break
    return last_paying + 1 if last_paying < largest else None


def stop_estimates(rows: list[dict], curve, largest: int, widest: int | None = None) -> dict:
    """Per pipeline, from its drafts at the smallest batch size run: where drafting as much
    as there stops paying (:func:`stop_estimate`) and where any drafting does
    (:func:`any_stop_estimate`, from the distribution of its first tokens' values where its
    proposals are valued, else from the share of first tokens accepted); in exact mode,
    within its widest pass (``widest`` rows). Sizes are searched up to 4 times ``largest``,
    and in exact mode at least to ``widest``, where no draft row is left: the estimate is
    then always a size."""
    searched = 4 * largest if widest is None else max(4 * largest, widest)
    estimates = {}
    for row in sorted(rows, key=lambda r: r["batch_size"]):
        name, accepted, drafted = row["pipeline"], row["accepted_per_request"], row["drafted_per_request"]
        if name not in estimates and drafted > 0:
            first = row.get("first_accepted", 0.0)
            leads = row.get("lead_value_quantiles") or []
            estimates[name] = {
                "batch_size": row["batch_size"],
                "accepted_per_request": accepted,
                "drafted_per_request": drafted,
                "first_accepted": first,
                "lead_value_quantiles": leads,
                "stops_at": stop_estimate(accepted, drafted, curve, searched, widest),
                "any_stops_at": any_stop_estimate(leads or first, curve, searched, widest),
                "widest_pass": widest,
                "searched_to": searched,
            }
    return estimates


def estimate_lines(payload: dict) -> list[str]:
    """One line per pipeline's estimates in a batch run's results (``payload["stop_estimates"]``)."""
    lines = []
    for name, estimate in (payload.get("stop_estimates") or {}).items():
        searched = estimate.get("searched_to", 4 * max(payload["batch_sizes"]))
        lines.append(
            f"cost model: {name} ({estimate['drafted_per_request']:.2f} drafted, "
            f"{estimate['accepted_per_request']:.2f} accepted per request per pass at batch "
            f"{estimate.get('batch_size', 1)}) {_stops_line(estimate['stops_at'], searched)}; "
            f"any draft token ({_leads_line(estimate)}) {_stops_line(estimate.get('any_stops_at'), searched)}"
            + (
                f" (exact mode: a pass holds at most {widest} rows, so B requests leave {widest} - B for drafts)"
                if (widest := estimate.get("widest_pass"))
                else ""
            )
        )
    return lines


def _stops_line(size: int | None, searched: int) -> str:
    """Where an estimate says drafting stops paying, or that it did not up to ``searched``."""
    return f"stops paying at batch size {size}" if size else f"pays at every batch size up to {searched}"


def _leads_line(estimate: dict) -> str:
    """What the estimate of where any drafting stops was made from."""
    leads = estimate.get("lead_value_quantiles")
    if leads:
        return f"likeliest first tokens valued {leads[len(leads) // 2]:.2f} median, {leads[-3]:.2f} p90"
    return f"first accepted {estimate.get('first_accepted', 0.0):.2f}"
