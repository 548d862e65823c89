//! The build-time gradient check: every element of every weight must be
//! reachable by the backward pass, and the gradient the backward computes must
//! be the derivative. A weight partly behind an op with no backward (candle-nn's
//! fused kernels) would otherwise train those elements on a silent zero, and a
//! weight used twice with one use cut would train on a wrong gradient.
//!
//! **One stage at a time.** The check walks the stages in order and holds one
//! stage's weights, its trial input and its graph at a time (plus, for a tied
//! weight, the stages that share it until the last of them is checked):
//!
//! 1. *Backward, in f32* (what training runs): the stage on its trial input (the
//!    first stage on every token id, in chunks of [`CHUNK_TOKENS`]; a later stage
//!    on [`LATER_ROWS`] rows of the previous stage's output) with a random
//!    upstream gradient. Per weight it keeps the elements whose gradient is
//!    exactly zero and the gradient along a random direction, `g · u` (a normal
//!    draw per element, a stream of its own per weight), then drops the gradients.
//! 2. *Finite differences, in f64* (candle runs f64 on the CPU): the objective
//!    `F = Σ ⟨out, up⟩` at `w + h·u` against `F` at `w` (computed once per
//!    stage), forward only, on the same inputs and upstream gradients. In f64
//!    the differences' rounding, `~1e-16 · Σ|out ⊙ up| / h`, and the one-sided
//!    step's truncation, `~h / rms(w)` of the derivative, both sit orders of
//!    magnitude below any real defect at any width, so the
//!    tolerance is derived from the arithmetic, not from the size: a gap above
//!    [`DIRECTION_TOL`] of the derivative (plus the bounds of both roundings) is a
//!    [`CandleError::WrongGradient`]; a second step size, `h / 8`, rules out a
//!    kink crossed by the first.
//! 3. *Influence, in f64*, only for weights with exact-zero gradient elements:
//!    moving those elements must leave every output unchanged (a key bias under
//!    softmax: the zero is the true gradient); a change above `1e-9` of the
//!    output's scale is a cut path, [`CandleError::PartialGradient`].
//!
//! A stage that looks at its [`StageContext`] (dropout, the mode, a seed) is
//! checked in evaluation *and* in training mode, the latter with its dropout
//! masks fixed (every rerun replays the stage's stream), so a path that only
//! training takes is checked too. Each rerun costs one forward of the stage on
//! its trial input: one per weight, one more where a weight has zero-gradient
//! elements or its first step fails, and one per stage for the base. The
//! check's time is linear in the parameters, and its memory one stage's
//! weights (f32 while it runs backward, f64 while it runs differences), its
//! gradients and its graph.
//!
//! **Split over a job.** Under a launcher (MPI, Slurm) each process tests its
//! share of the weights (weight `i` of the model when `i % world == rank`,
//! [`CandleModelBuilder::check_share`](super::CandleModelBuilder::check_share))
//! after running every stage's trial backward: the job checks every weight
//! once, and each process spends `1 / world` of the differences' time.
//!
//! **What it cannot see**: a path the trial input does not take (a branch on the
//! data, a mask that hides a row of a later stage's two trial rows); a weight
//! whose stage does not run in f64 is checked by its finite differences in f32
//! instead, where the rounding bound grows with the stage's size and a small cut
//! path can hide: [`CandleModel::gradient_check_notes`] names each such weight.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;
use zeropp_quant::rng::stream_seed;

use super::{CandleModel, StageContext, stage_key};
use crate::error::{CandleError, Result};
use crate::params::{Gathered, init_param};

mod differences;
mod probe;

use probe::{Seen, Trial, noise, normals};

/// The seed of the check's weights, inputs, directions and upstream gradients.
const PROBE_SEED: u64 = 0x6E_AD_C4_EC;

/// Rows of a later stage's trial input (the first stage sees every token id).
const LATER_ROWS: usize = 2;

/// Tokens per chunk of the first stage's trial input.
pub(super) const CHUNK_TOKENS: usize = 2048;

/// The share of a weight's directional derivative that a wrong gradient must
/// miss to be reported: a cut path carrying twice this share is caught.
pub(super) const DIRECTION_TOL: f64 = 0.05;

/// f64's unit roundoff.
const EPS64: f64 = f64::EPSILON / 2.0;
/// f32's unit roundoff.
const EPS32: f64 = f32::EPSILON as f64 / 2.0;
/// How many roundings a stage's output (or a gradient element) may carry, in
/// units of the roundoff: a stage's depth of operations, with room to spare.
const DEPTH: f64 = 1024.0;

/// One weight under test: its owner stage and index, and the stages using it.
#[derive(Debug, Clone)]
struct Target {
    owner: usize,
    param: usize,
    users: Vec<usize>,
}

/// The key of a base objective: the stages a weight's differences rerun, and
/// the mode.
type BaseKey = (Vec<usize>, bool);

/// The check's state across stages: each stage's weights while it (or a
/// weight it shares) is under test, and the trials and backward results of
/// tied weights whose last user has not run yet.
struct Walk {
    /// Stage weights, by stage: f32 `Var` tensors while the backward runs, f64
    /// copies (the f32 ones dropped) while the differences run.
    weights: HashMap<usize, Vec<Tensor>>,
    /// Trials of the stages kept for a pending tie, by stage and mode.
    trials: HashMap<(usize, bool), Trial>,
    /// Backward results of tied weights, by (owner, param, mode).
    tied: HashMap<(usize, usize, bool), Seen>,
    /// What could not be checked in f64.
    notes: Vec<String>,
    /// The objective at the held weights, by (users, mode): the base of the
    /// one-sided differences.
    bases: std::cell::RefCell<HashMap<BaseKey, (f64, f64)>>,
}

impl CandleModel {
    /// Stage `l` (the check's own lookup, with the crate's error).
    fn probe_stage(&self, l: usize) -> Result<&super::StageDef> {
        self.stages.get(l).ok_or_else(|| {
            CandleError::Config(format!("gradient check: no stage {l} of {}", self.stages.len()))
        })
    }

    /// Runs the check (see the module docs); fails on a weight with no
    /// gradient, a stage input with none, a weight element whose gradient is
    /// exactly zero although it changes the output (unless its name is in
    /// `allowed`), and a gradient that disagrees with the derivative.
    /// Only weights in `share` (`(part, parts)`: weight `i` over the stages in
    /// order when `i % parts == part`) are tested against finite differences.
    pub(super) fn check_gradient_paths(
        &self,
        allowed: &[String],
        share: (usize, usize),
    ) -> Result<Vec<String>> {
        let (looked, mut notes) = self.walk(false, allowed, None, share)?;
        if !looked.is_empty() {
            // Some stage reads its context (dropout): training mode too, masks fixed,
            // testing the weights such a stage uses.
            notes.extend(self.walk(true, allowed, Some(&looked), share)?.1);
        }
        Ok(notes)
    }

    /// Whether weight `(owner, param)` is in `share` (see
    /// [`CandleModel::check_gradient_paths`]).
    fn in_share(&self, owner: usize, param: usize, (part, parts): (usize, usize)) -> bool {
        let before: usize = self.stages.iter().take(owner).map(|s| s.params.len()).sum();
        (before + param) % parts.max(1) == part
    }

    /// One pass over the stages in `train` mode, testing every weight (or, with
    /// `only`, the weights some stage of `only` uses); returns the stages that
    /// read their context and what could not be checked in f64.
    fn walk(
        &self,
        train: bool,
        allowed: &[String],
        only: Option<&[usize]>,
        share: (usize, usize),
    ) -> Result<(Vec<usize>, Vec<String>)> {
        let rows = self.vocab.div_ceil(self.seq_len).max(1);
        let ids: Vec<u32> = (0..rows * self.seq_len).map(|i| (i % self.vocab) as u32).collect();
        let per = (CHUNK_TOKENS / self.seq_len).max(1);
        let mut inputs = Vec::with_capacity(rows.div_ceil(per));
        for r in (0..rows).step_by(per) {
            let n = per.min(rows - r);
            let part = ids[r * self.seq_len..(r + n) * self.seq_len].to_vec();
            inputs.push(Tensor::from_vec(part, (n, self.seq_len), &Device::Cpu)?);
        }
        let mut walk = Walk {
            weights: HashMap::new(),
            trials: HashMap::new(),
            tied: HashMap::new(),
            notes: Vec::new(),
            bases: std::cell::RefCell::new(HashMap::new()),
        };
        let mut looked = Vec::new();
        for l in 0..self.stages.len() {
            walk.weights.insert(l, self.probe_weights(l)?);
            let trial = Trial { inputs, train };
            let (next, looks) = self.check_stage(l, &trial, &mut walk, allowed, only, share)?;
            if looks {
                looked.push(l);
            }
            inputs = vec![next];
            // Forget the weights and trials no pending tie needs.
            let pending: Vec<usize> = walk.tied.keys().flat_map(|&(o, p, _)| self.users(o, p)).collect();
            walk.weights.retain(|s, _| pending.contains(s));
            walk.trials.retain(|(s, _), _| pending.contains(s));
        }
        Ok((looked, walk.notes))
    }

    /// Stage `l`'s weights, perturbed from their init (so no element is zero by
    /// construction, such as a LoRA factor initialised to zero).
    fn probe_weights(&self, l: usize) -> Result<Vec<Tensor>> {
        let stage = self.probe_stage(l)?;
        let mut out = Vec::with_capacity(stage.params.len());
        for (i, p) in stage.params.iter().enumerate() {
            let mut v = vec![0.0f32; p.numel()];
            init_param(&p.init, &p.shape, PROBE_SEED, l, i, &mut v);
            let key = stream_seed(PROBE_SEED, &[1, l as u64, i as u64]);
            for (d, n) in v.iter_mut().zip(noise(key, p.numel(), 0.05)) {
                *d += n;
            }
            // A `Var`'s tensor, so the backward's `Var::from_tensor` does not copy it.
            out.push(Var::from_vec(v, p.shape.as_slice(), &Device::Cpu)?.as_tensor().clone());
        }
        Ok(out)
    }

    /// Converts the weights of `stages` held in `walk` to `dtype` in place (the
    /// old copies dropped, so a stage's weights exist once); f32 ones become
    /// `Var` tensors again.
    fn hold_as(&self, walk: &mut Walk, stages: &[usize], dtype: DType) -> Result<()> {
        for s in stages {
            if let Some(ws) = walk.weights.get_mut(s) {
                for w in ws.iter_mut() {
                    if w.dtype() != dtype {
                        // Detached: a conversion of a `Var` would otherwise keep the `Var`
                        // alive and make every rerun record its graph.
                        let t = w.to_dtype(dtype)?.detach();
                        *w = if dtype == DType::F32 { Var::from_tensor(&t)?.as_tensor().clone() } else { t };
                    }
                }
            }
        }
        Ok(())
    }

    /// The upstream gradient of stage `u`'s output on chunk `c` in `train`
    /// mode (f32 values; the same in the backward and the differences).
    fn upstream(&self, u: usize, c: usize, train: bool, shape: &candle_core::Shape) -> Result<Tensor> {
        let key = stream_seed(PROBE_SEED, &[2, u as u64, c as u64, u64::from(train)]);
        Ok(Tensor::from_iter(noise(key, shape.elem_count(), 1.0), &Device::Cpu)?.reshape(shape)?)
    }

    /// The direction of weight `(owner, param)` in `train` mode: a standard
    /// normal draw per element.
    fn direction(&self, owner: usize, param: usize, train: bool) -> Result<Vec<f32>> {
        let info = self
            .probe_stage(owner)?
            .params
            .get(param)
            .ok_or_else(|| CandleError::Config("gradient check: no such parameter".into()))?;
        let key = stream_seed(PROBE_SEED, &[4, owner as u64, param as u64, u64::from(train)]);
        Ok(normals(key, info.numel()))
    }

    /// Stage `u`'s named weights from `walk` (own, aliases and borrowed), in
    /// `dtype`, with `(owner, param)` replaced by `moved` when given; `vars`
    /// makes them candle `Var`s (returned, own first, then borrowed).
    fn stage_weights(
        &self,
        u: usize,
        walk: &Walk,
        dtype: DType,
        moved: Option<((usize, usize), &Tensor)>,
        vars: bool,
    ) -> Result<(Gathered, Vec<Var>)> {
        let s = self.probe_stage(u)?;
        let value = |owner: usize, param: usize| -> Result<Tensor> {
            if let Some((at, t)) = moved
                && at == (owner, param)
            {
                return Ok(t.clone());
            }
            let w = walk.weights.get(&owner).and_then(|w| w.get(param)).ok_or_else(|| {
                CandleError::Config(format!("gradient check: stage {u}'s weight ({owner}, {param}) is gone"))
            })?;
            // Held in `dtype` already (`hold_as`): a clone of the handle, no copy.
            Ok(w.to_dtype(dtype)?)
        };
        let mut tensors = HashMap::with_capacity(s.params.len() + s.borrows.len());
        let mut out_vars = Vec::new();
        // A `Var` of an f32 weight is the weight itself (held as a `Var` tensor).
        let mut track = |t: Tensor| -> Result<Tensor> {
            if !vars {
                return Ok(t);
            }
            let v = Var::from_tensor(&t)?;
            let t = v.as_tensor().clone();
            out_vars.push(v);
            Ok(t)
        };
        let mut own = Vec::with_capacity(s.params.len());
        for (i, p) in s.params.iter().enumerate() {
            let t = track(value(u, i)?)?;
            tensors.insert(p.name.clone(), t.clone());
            own.push(t);
        }
        for (alias, i) in &s.aliases {
            let t =
                own.get(*i).cloned().ok_or_else(|| CandleError::Config("alias of a missing param".into()))?;
            tensors.insert(alias.clone(), t);
        }
        for b in &s.borrows {
            let t = track(value(b.owner, b.param)?)?;
            tensors.insert(b.local.clone(), t);
        }
        Ok((Gathered { stage: s.name.clone(), tensors }, out_vars))
    }

    /// Stage `u` on `input` with weights `g`, in `trial`'s mode: its output and
    /// whether it read its context.
    fn run_on(
        &self,
        u: usize,
        g: Gathered,
        dtype: DType,
        input: &Tensor,
        train: bool,
    ) -> Result<(Tensor, bool)> {
        let s = self.probe_stage(u)?;
        let ctx = StageContext::new(train, stage_key(PROBE_SEED, u));
        let vb = VarBuilder::from_backend(Box::new(g), dtype, Device::Cpu);
        let out = (s.run)(vb, input, &ctx).map_err(|e| {
            CandleError::Config(format!(
                "stage {:?} failed in the gradient check ({dtype:?}, a batch of {} sequences): {e}",
                s.name,
                input.dim(0).unwrap_or(0)
            ))
        })?;
        Ok((out, ctx.looked()))
    }

    /// Checks stage `l` in `trial`'s mode: the backward (its own weights, the
    /// weights it borrows, its input), then the differences and influence of
    /// every weight whose last user it is. Returns the next stage's trial input
    /// (the output on the first rows) and whether the stage read its context.
    fn check_stage(
        &self,
        l: usize,
        trial: &Trial,
        walk: &mut Walk,
        allowed: &[String],
        only: Option<&[usize]>,
        share: (usize, usize),
    ) -> Result<(Tensor, bool)> {
        let stage = self.probe_stage(l)?;
        let mut seen: Vec<Seen> = stage.params.iter().map(|p| Seen::new(p.numel())).collect();
        let mut lent: Vec<Seen> = stage
            .borrows
            .iter()
            .map(|b| self.probe_stage(b.owner).map(|o| Seen::new(o.params[b.param].numel())))
            .collect::<Result<_>>()?;
        let (mut next, mut looks) = (None, false);
        let users: Vec<usize> = std::iter::once(l).chain(stage.borrows.iter().map(|b| b.owner)).collect();
        self.hold_as(walk, &users, DType::F32)?;
        let (weights, vars) = self.stage_weights(l, walk, DType::F32, None, true)?;
        for (c, input) in trial.inputs.iter().enumerate() {
            let g = Gathered { stage: weights.stage.clone(), tensors: weights.tensors.clone() };
            let x = if l == 0 { None } else { Some(Var::from_tensor(input)?) };
            let (out, looked) =
                self.run_on(l, g, DType::F32, x.as_ref().map_or(input, |v| v.as_tensor()), trial.train)?;
            looks |= looked;
            let up = self.upstream(l, c, trial.train, out.shape())?;
            let store = (out.to_dtype(DType::F32)? * &up)?.sum_all()?.backward()?;
            let missing =
                |param: &str| CandleError::MissingGradient { stage: stage.name.clone(), param: param.into() };
            let (own_vars, borrowed_vars) = vars.split_at(stage.params.len());
            // Each weight's direction made as its gradient is read (one weight's worth at a time).
            for (i, ((v, info), s)) in own_vars.iter().zip(&stage.params).zip(seen.iter_mut()).enumerate() {
                let g = store.get(v.as_tensor()).ok_or_else(|| missing(&info.name))?;
                s.add(g, &self.direction(l, i, trial.train)?)?;
            }
            for ((v, b), s) in borrowed_vars.iter().zip(&stage.borrows).zip(lent.iter_mut()) {
                let g = store.get(v.as_tensor()).ok_or_else(|| missing(&b.local))?;
                s.add(g, &self.direction(b.owner, b.param, trial.train)?)?;
            }
            if let Some(x) = &x
                && store.get(x.as_tensor()).is_none()
            {
                return Err(CandleError::MissingInputGradient { stage: stage.name.clone() });
            }
            if c == 0 {
                let first = out.detach();
                next = Some(if first.dim(0)? > LATER_ROWS { first.narrow(0, 0, LATER_ROWS)? } else { first });
            }
        }
        drop((weights, vars));
        let next =
            next.ok_or_else(|| CandleError::Config(format!("stage {:?}: no trial input", stage.name)))?;
        // Weights this stage owns and nobody borrows are done; the others wait for
        // their last user.
        let mut done: Vec<(Target, Seen)> = Vec::new();
        for (i, s) in seen.into_iter().enumerate() {
            let target = Target { owner: l, param: i, users: self.users(l, i) };
            if target.users.last() == Some(&l) {
                done.push((target, s));
            } else {
                walk.tied.insert((l, i, trial.train), s);
                walk.trials.insert((l, trial.train), trial.clone());
            }
        }
        for (b, s) in stage.borrows.iter().zip(lent) {
            let key = (b.owner, b.param, trial.train);
            let acc = walk.tied.remove(&key).ok_or_else(|| {
                CandleError::Config(format!(
                    "stage {:?}: tied weight {:?} before its owner",
                    stage.name, b.local
                ))
            })?;
            let merged = Seen {
                zero: acc.zero.iter().zip(&s.zero).map(|(a, b)| *a && *b).collect(),
                dot: acc.dot + s.dot,
                sq: acc.sq + s.sq,
            };
            let target = Target { owner: b.owner, param: b.param, users: self.users(b.owner, b.param) };
            if target.users.last() == Some(&l) {
                done.push((target, merged));
            } else {
                walk.tied.insert(key, merged);
                walk.trials.insert((l, trial.train), trial.clone());
            }
        }
        walk.trials.insert((l, trial.train), trial.clone());
        if let Some(only) = only {
            done.retain(|(t, _)| t.users.iter().any(|u| only.contains(u)));
        }
        done.retain(|(t, _)| self.in_share(t.owner, t.param, share));
        if !done.is_empty() {
            // The differences run in f64: every stage they rerun held in f64 alone.
            let mut involved: Vec<usize> = done.iter().flat_map(|(t, _)| t.users.clone()).collect();
            for &u in &involved.clone() {
                involved.extend(self.probe_stage(u)?.borrows.iter().map(|b| b.owner));
            }
            involved.sort_unstable();
            involved.dedup();
            self.hold_as(walk, &involved, DType::F64)?;
            for (target, s) in done {
                if let Some(note) = self.test_weight(&target, s, trial.train, walk, allowed)? {
                    walk.notes.push(note);
                }
            }
        }
        Ok((next, looks))
    }

    /// The stages that use parameter `(owner, param)`: its own, and those it
    /// is tied into, in order.
    fn users(&self, owner: usize, param: usize) -> Vec<usize> {
        std::iter::once(owner)
            .chain(
                self.stages
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.borrows.iter().any(|b| (b.owner, b.param) == (owner, param)))
                    .map(|(u, _)| u),
            )
            .collect()
    }
}
