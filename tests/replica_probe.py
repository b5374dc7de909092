"""What the replicas actually computed, counted inside a rank: the rows each replica slot ran, by the rank that
masters the expert and the rank that computed it — not what the plans said they would."""

from __future__ import annotations


def served_rows() -> dict[tuple[int, int], int]:
    """From now on in this rank's process (ranks are forked: the patch ends with the rank), count the token rows
    every replica computes in a forward (a layer call's, or an activation-checkpoint recompute's), from the rows
    handed to the replica job: ``{(master rank, replica rank): rows}``, filled as the replicas run."""
    from ultraep.runtime.replicas import ReplicaJob

    served: dict[tuple[int, int], int] = {}

    def count(job, x_rep):
        assert x_rep.shape[0] == sum(job.counts), (x_rep.shape, job.counts)
        row = job.plan.phy2log_RS[job.me]
        for i, c in enumerate(job.counts):
            e = int(row[job.M + i])
            if c and e >= 0:
                key = (e // job.M, job.me)
                served[key] = served.get(key, 0) + int(c)

    compute, recompute = ReplicaJob.compute, ReplicaJob.recompute

    def counting_compute(job, x_rep, build_graph):
        count(job, x_rep)
        return compute(job, x_rep, build_graph)

    def counting_recompute(job, x_rep):
        count(job, x_rep)
        return recompute(job, x_rep)

    ReplicaJob.compute, ReplicaJob.recompute = counting_compute, counting_recompute
    return served
