"""The sections of the run spec that describe how peers work together: the outer algorithm, the codecs per
tensor role, the pipeline split, and the network's timeouts and limits.

Each a frozen, keyword-only dataclass with a docstring per field, validated at construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from locomm.config.base import check, choice, fraction, positive

# --------------------------------------------------------------------------- outer

OUTER_ALGOS = ("none", "ddp", "diloco", "noloco", "gasloc", "sparseloco")
GASLOC_TOPOLOGIES = ("matching", "ring", "kpeers", "complete")


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """The outer algorithm (docs/algorithms.md §1-4). Defaults are the documented ones."""

    algo: str = "none"
    """none (single node), ddp, diloco, noloco, gasloc or sparseloco."""
    inner_steps: int = 50
    """H: inner steps per outer round."""
    apply_delay_steps: int = 0
    """With overlap, a round's exchange is applied after this many inner steps of the next round (0: all H,
    exactly one round late). Fixed in steps, so the numerics do not depend on the network; a smaller delay
    (Streaming DiLoCo uses a few steps) converges closer to a blocking exchange, and compute waits at that
    step if the exchange has not arrived."""
    lr: float = 0.7
    """Outer learning rate (DiLoCo eta, NoLoCo alpha, GASLoC eta, SparseLoCo alpha)."""
    momentum: float = 0.9
    """DiLoCo outer momentum mu."""
    nesterov: bool = True
    """DiLoCo's outer SGD: Nesterov momentum (DiLoCo's paper) or heavy-ball (false; NoLoCo's DiLoCo baseline)."""
    noloco_beta: float = 0.5
    """NoLoCo momentum beta."""
    noloco_gamma: float | None = None
    """NoLoCo weight on (mean outer weights - own outer weights); None means = lr."""
    group_size: int = 2
    """n: workers per NoLoCo group."""
    gasloc_mix: float = 0.5
    """GASLoC gossip step a (1/2 = exact pair average)."""
    gasloc_gamma: float = 0.0
    """GASLoC momentum gamma on the mixed points. 0 (plain gossip with local steps) was best in
    benchmarks/tune_gasloc.py (4 workers, nano, H=20, 10 rounds): val 2.416 at gamma 0, 2.459 at 0.5,
    2.660 at 0.9 (eta 0.7, a 0.5); raise it for long runs, where acceleration is meant to pay off."""
    gasloc_momentum_on: str = "mixed"
    """Where GASLoC's momentum acts: 'mixed' (z, reproduces DiLoCo on a complete graph) or 'unmixed' (y)."""
    topology: str = "matching"
    """GASLoC graph per round: matching, ring, kpeers or complete."""
    k_peers: int = 2
    """Peers per worker for topology=kpeers."""
    participation: float = 1.0
    """Per-round probability that a worker takes part in the exchange."""
    sparse_density: float = 0.02
    """SparseLoCo top-k density (share of each chunk of 64 that is sent)."""
    sparse_ef_beta: float = 0.95
    """SparseLoCo error-feedback decay."""
    sparse_lr: float = 3.0
    """SparseLoCo outer learning rate alpha. 3.0: the best of the tuning sweep's points run so far under the
    paper's aggregation (benchmarks/results/tune/sparseloco, 8 workers); 1.0 suited the sender-mean rule."""
    sparseloco_aggregation: str = "all"
    """SparseLoCo's mean of the workers' sparse updates: 'all' (the paper's: over every worker of the exchange,
    an index a worker did not send counting as 0) or 'senders' (each index over the workers that sent it)."""
    sparseloco_clip: str = "none"
    """'median': before the mean, each sender's update to a tensor is scaled down to the median norm of the
    round's senders for that tensor (the public code's robustness step); 'none' (the paper's box)."""
    scape_sparsity: float = 0.9
    """SCAPE's per-step sync inside an island (docs/algorithms.md §5): the fraction of coordinates NOT sent, in
    [0, 1) (0.9 and 0.99 in the paper; 0 is dense AdamS data parallelism). Distinct from ``sparse_density``,
    SparseLoCo's share that IS sent once a round."""
    scape_error_feedback: bool = True
    """SCAPE: keep the off-mask part of each step's gradient in a local residual, added to the next step's
    (error feedback), or drop it (false)."""
    scape_hold: bool = True
    """SCAPE: off the step's mask, AdamS holds weights, first moment and decay (the step updates the synchronized
    coordinates only); false steps every coordinate on a zero gradient there, along stale momentum."""
    scape_residual_decay: float = 1.0
    """SCAPE: the error-feedback residual is multiplied by this each step before the gradient is added (1: never
    decayed, unbounded; 0.9 bounds it at 10x the largest gradient). Defaults (hold on, decay 1, weight 0, no
    warm-up) are the best measured at 90% (docs/results/scape.md); at 99%, decay 0.9, weight 0.1 and 20 dense
    steps measured better."""
    scape_residual_weight: float = 0.0
    """SCAPE: a mask slice's owner ranks coordinates by |m + w*r| (its residual r): unsent gradient brings a
    coordinate back to the mask; 0 ranks by |m| alone."""
    scape_dense_steps: int = 0
    """SCAPE: the first steps send every coordinate (a dense warm-up; the first two are dense in any case: the
    first mask needs a moment)."""
    seed: int = 0
    """Seed of the per-round group permutations (the same on every worker)."""

    def __post_init__(self) -> None:
        choice(self, "algo", OUTER_ALGOS)
        choice(self, "topology", GASLOC_TOPOLOGIES)
        choice(self, "gasloc_momentum_on", ("mixed", "unmixed"))
        choice(self, "sparseloco_aggregation", ("all", "senders"))
        choice(self, "sparseloco_clip", ("none", "median"))
        check(self.inner_steps >= 1, "inner_steps", f"H must be >= 1, got {self.inner_steps}")
        check(
            0 <= self.apply_delay_steps <= self.inner_steps,
            "apply_delay_steps",
            f"must be in [0, inner_steps={self.inner_steps}], got {self.apply_delay_steps}",
        )
        check(self.group_size >= 2, "group_size", f"must be >= 2, got {self.group_size}")
        check(self.k_peers >= 1, "k_peers", f"must be >= 1, got {self.k_peers}")
        positive(self, "lr", "sparse_lr")
        fraction(self, "momentum", "noloco_beta", "gasloc_gamma", "sparse_ef_beta", closed_high=False)
        fraction(self, "gasloc_mix")
        fraction(self, "participation", "sparse_density", closed_low=False)
        fraction(self, "scape_sparsity", closed_high=False)
        fraction(self, "scape_residual_decay", closed_low=False)
        check(
            self.scape_residual_weight >= 0, "scape_residual_weight", f"must be >= 0, got {self.scape_residual_weight}"
        )
        check(self.scape_dense_steps >= 0, "scape_dense_steps", f"must be >= 0, got {self.scape_dense_steps}")
        check(isinstance(self.scape_hold, bool), "scape_hold", f"must be true or false, got {self.scape_hold!r}")
        check(
            isinstance(self.scape_error_feedback, bool),
            "scape_error_feedback",
            f"must be true or false, got {self.scape_error_feedback!r}",
        )

    @property
    def gamma(self) -> float:
        """NoLoCo's consensus weight, defaulting to the outer lr as the public code does."""
        return self.lr if self.noloco_gamma is None else self.noloco_gamma


# --------------------------------------------------------------------- compression

TENSOR_ROLES = ("parameter", "outer_gradient", "activation", "act_gradient")


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """Codec stack per tensor role: names joined by '+', lossy first, then lossless."""

    parameter: str = "lossless"
    outer_gradient: str = "lossless"
    activation: str = "subspace+lossless"
    act_gradient: str = "subspace+lossless"
    subspace_rate: int = 32
    """Protocol Models rate: k = d_model / rate."""

    def __post_init__(self) -> None:
        for role in TENSOR_ROLES:
            check(bool(getattr(self, role)), role, "must name at least one codec")
        positive(self, "subspace_rate")


# ------------------------------------------------------------------------ pipeline


SUBSPACE_FORMS = ("project", "reparam")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Pipeline mode (docs/algorithms.md §7): the model split into stages served by different peers."""

    stages: int = 1
    """Number of pipeline stages (1: no pipeline; every peer holds the whole model)."""
    layers: tuple[int, ...] = ()
    """Transformer blocks per stage, e.g. [3, 5]; empty means an even split (earlier stages take the extra)."""
    micro_batch_size: int = 4
    """Sequences per micro-batch; data.batch_size must be a multiple (an optimizer step takes a whole batch)."""
    in_flight: int = 2
    """Micro-batches a stage-0 replica keeps in the pipeline at once (1F1B-style overlap of the stages)."""
    subspace: bool = True
    """Keep the residual stream in span(U) and send z = U^T (h - E_f[tok]) (k = d_model / compression.subspace_rate
    numbers per token); false sends h itself with the activation codec's casts (the uncompressed comparison)."""
    free_tail_layers: int = -1
    """Blocks at the end of the last stage left out of the constraint; -1 (default): the whole last stage.
    Only blocks before the last boundary must write into span(U) for the boundary map to be exact, so every
    value keeps it exact. node0 leaves 2; on tiny at 32x, 2 stages, 311 steps, freeing the whole last stage
    (4 blocks) ends at 1.914 against 1.970 (benchmarks/pipeline.py, tiny32_free vs tiny32)."""
    fixed_embed_std: float = 1.0
    """Standard deviation of the fixed random token embedding E_f that stage 0 adds and the receiver of z
    rebuilds (with ``subspace``). Part of the shared geometry: every stage and the boundary codec derive E_f
    from (seed, std). 1.0 as in Pluralis' ProtocolNanoGPT; with ``branch_norm`` it holds the loss at 32x where
    0.02 (the old default) lost 7.6% (docs/results/pipeline.md, "The subspace at the k that holds the loss")."""
    branch_norm: bool | None = None
    """node0's block form: a non-trainable RMSNorm on each attention and MLP branch output before it is added
    to the residual stream (``h + rmsnorm(f(norm(h)))``); without a gain it only rescales each token's write,
    so a write in span(U) stays there. None (default): on with ``subspace``, where E_f at std 1 sets the scale
    the writes are normalised to; off without it (the plain pipeline loses 7% with it at std-0.02 embeddings)."""
    subspace_form: str = "project"
    """How the writes into the residual stream (W_o, W_2, E_learn) are kept in span(U): 'project' (onto span(U)
    after every optimizer step; the optimizer sees the full gradient) or 'reparam' (W = U U^T W': the gradient
    reaching the optimizer is projected too, so its state never holds the part the projection discards). Measured
    no better at d=256 (docs/results/pipeline.md): the gap is the scale of E_f, not the optimizer's state."""
    stage_timeout_s: float = 60.0
    """How long a stage waits for the rest of the pipeline to answer one micro-batch (forward and backward)."""
    reroute_attempts: int = 3
    """Other replicas of the next stage tried for a micro-batch before it counts as lost."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        positive(self, "stages", "micro_batch_size", "in_flight", "stage_timeout_s", "fixed_embed_std")
        check(math.isfinite(self.fixed_embed_std), "fixed_embed_std", f"must be finite, got {self.fixed_embed_std}")
        choice(self, "subspace_form", SUBSPACE_FORMS)
        check(
            self.branch_norm is None or isinstance(self.branch_norm, bool),
            "branch_norm",
            f"must be true, false or unset, got {self.branch_norm!r}",
        )
        check(self.reroute_attempts >= 0, "reroute_attempts", f"must be >= 0, got {self.reroute_attempts}")
        check(
            self.free_tail_layers >= -1,
            "free_tail_layers",
            f"must be >= 0, or -1 for the whole last stage; got {self.free_tail_layers}",
        )
        check(
            all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in self.layers),
            "layers",
            f"must be positive integers, got {list(self.layers)}",
        )
        check(
            not self.layers or len(self.layers) == self.stages,
            "layers",
            f"gives {len(self.layers)} stages, stages = {self.stages}",
        )


# ------------------------------------------------------------------------- network


@dataclass(frozen=True, kw_only=True)
class NetworkConfig:
    """Timeouts and limits shared by every peer of a run."""

    request_timeout_s: float = 30.0
    """Bound on a small request (a header, a manifest, an answer); transfers are bounded by size instead."""
    stall_timeout_s: float = 20.0
    """A transfer with no progress (no byte read or written) for this long is cut off."""
    min_rate_mbit: float = 10.0
    """Floor rate of a transfer: its deadline is its declared size at this rate (plus slack), and over any
    ``rate_window_s`` of waiting it must move at least this much, so a trickling sender is cut off."""
    rate_window_s: float = 30.0
    max_wait_s: float = 600.0
    """The most a worker waits for a partner's payload beyond the ETA the partner publishes."""
    streams_per_transfer: int = 4
    """A payload above ``parallel_threshold_mb`` travels over up to this many parallel streams to one partner."""
    parallel_threshold_mb: float = 16.0
    max_streams_per_peer: int = 16
    """Open streams one remote peer may hold at once; more are refused with NOT_READY."""
    max_inbound_streams: int = 256
    """Open inbound streams a peer serves at once from all peers together (ids are free, so the per-peer cap
    alone bounds nothing); more are refused with NOT_READY before their header is read. Each admitted stream
    may buffer a header of up to 1 MiB, so this also bounds that memory."""
    heartbeat_interval_s: float = 5.0
    heartbeat_ttl_s: float = 30.0
    max_message_mb: float = 1024.0
    """A message larger than this is refused before it is read."""
    max_faults_before_ban: int = 3

    def __post_init__(self) -> None:
        positive(
            self,
            "request_timeout_s",
            "heartbeat_interval_s",
            "heartbeat_ttl_s",
            "max_message_mb",
            "max_faults_before_ban",
            "stall_timeout_s",
            "min_rate_mbit",
            "rate_window_s",
            "max_wait_s",
            "streams_per_transfer",
            "parallel_threshold_mb",
            "max_streams_per_peer",
            "max_inbound_streams",
        )
        check(
            self.streams_per_transfer <= 16, "streams_per_transfer", f"must be <= 16, got {self.streams_per_transfer}"
        )
        check(self.heartbeat_ttl_s > self.heartbeat_interval_s, "heartbeat_ttl_s", "must exceed heartbeat_interval_s")
