//! The finite-difference and influence half of the check: each weight's
//! user stages rerun with the weight moved (along its direction, or on its
//! zero-gradient elements), compared against the backward's [`Seen`].

use candle_core::{DType, Device, Tensor};
use zeropp_quant::rng::stream_seed;

use super::probe::{Seen, describe, noise};
use super::{CandleModel, DEPTH, DIRECTION_TOL, EPS32, EPS64, PROBE_SEED, Target, Walk};
use crate::error::{CandleError, Result};

/// One weight's reruns in one mode: the weight, training or evaluation mode,
/// the walk's trials and held weights, and the dtype the reruns run in.
#[derive(Clone, Copy)]
struct Rerun<'a> {
    target: &'a Target,
    train: bool,
    walk: &'a Walk,
    dtype: DType,
}

impl CandleModel {
    /// Runs every user stage of `target` on each chunk of its trial, in `dtype`,
    /// with the weight replaced by `moved`, handing `f` the stage, the chunk,
    /// the input and the output: the one rerun both probes below make.
    fn rerun_moved(
        &self,
        r: Rerun<'_>,
        moved: &Tensor,
        mut f: impl FnMut(usize, usize, &Tensor, Tensor) -> Result<()>,
    ) -> Result<()> {
        let Rerun { target, train, walk, dtype } = r;
        for &u in &target.users {
            let trial = walk
                .trials
                .get(&(u, train))
                .ok_or_else(|| CandleError::Config(format!("gradient check: stage {u}'s trial is gone")))?;
            for (c, input) in trial.inputs.iter().enumerate() {
                let x = if input.dtype() == DType::U32 { input.clone() } else { input.to_dtype(dtype)? };
                let (g, _) =
                    self.stage_weights(u, walk, dtype, Some(((target.owner, target.param), moved)), false)?;
                let (out, _) = self.run_on(u, g, dtype, &x, train)?;
                f(u, c, &x, out)?;
            }
        }
        Ok(())
    }

    /// `F = Σ_users Σ_chunks ⟨out, up⟩` and `Σ |out ⊙ up|` with weight
    /// `target` replaced by `moved`, in `dtype`.
    fn objective(&self, r: Rerun<'_>, moved: &Tensor) -> Result<(f64, f64)> {
        let (mut f, mut size) = (0.0, 0.0);
        self.rerun_moved(r, moved, |u, c, _, out| {
            let up = self.upstream(u, c, r.train, out.shape())?.to_dtype(DType::F64)?;
            let prod = (out.to_dtype(DType::F64)? * up)?;
            f += prod.sum_all()?.to_scalar::<f64>()?;
            size += prod.abs()?.sum_all()?.to_scalar::<f64>()?;
            Ok(())
        })?;
        Ok((f, size))
    }

    /// The largest change of any user's output on its trial when weight
    /// `target` is `moved` instead of its value, and the outputs' scale.
    fn output_change(&self, r: Rerun<'_>, moved: &Tensor) -> Result<(f64, f64)> {
        let (mut change, mut scale) = (0.0f64, 0.0f64);
        self.rerun_moved(r, moved, |u, _, x, out| {
            let (g, _) = self.stage_weights(u, r.walk, r.dtype, None, false)?;
            let (base, _) = self.run_on(u, g, r.dtype, x, r.train)?;
            let base = base.to_dtype(DType::F64)?;
            scale = scale.max(base.abs()?.max_all()?.to_scalar::<f64>()?);
            change = change.max((out.to_dtype(DType::F64)? - base)?.abs()?.max_all()?.to_scalar::<f64>()?);
            Ok(())
        })?;
        Ok((change, scale))
    }

    /// The influence and directional tests of one weight (its backward seen),
    /// in f64, or in f32 where a user stage does not run in f64 (said in the
    /// returned note).
    pub(super) fn test_weight(
        &self,
        target: &Target,
        seen: Seen,
        train: bool,
        walk: &Walk,
        allowed: &[String],
    ) -> Result<Option<String>> {
        let stage = self.probe_stage(target.owner)?;
        let info = &stage.params[target.param];
        let full = format!("{}.{}", stage.name, info.name);
        if allowed.contains(&full) {
            return Ok(None);
        }
        // The weight as `check_stage` holds it (f64, contiguous): read in place.
        let w = walk
            .weights
            .get(&target.owner)
            .and_then(|w| w.get(target.param))
            .ok_or_else(|| CandleError::Config(format!("gradient check: weight {full} is gone")))?;
        let rms = with_values(w, |v| (v.iter().map(|x| x * x).sum::<f64>() / v.len().max(1) as f64).sqrt())?;
        let rms = rms.max(0.01);
        let rerun = |dtype| Rerun { target, train, walk, dtype };
        match self.test_in(rerun(DType::F64), &seen, w, rms) {
            Ok(()) => Ok(None),
            Err(e @ (CandleError::PartialGradient { .. } | CandleError::WrongGradient { .. })) => Err(e),
            // A user stage that does not run in f64 (a tensor made in f32 inside it):
            // the same tests in f32, with f32's bounds.
            Err(f64_failed) => {
                self.test_in(rerun(DType::F32), &seen, w, rms)?;
                // The reason's first line (candle's errors carry a backtrace after it).
                let why = f64_failed.to_string();
                let why = why.lines().next().unwrap_or_default();
                Ok(Some(format!(
                    "{full} ({} mode) was checked in f32, its stages not running in f64 ({why}): its finite \
                     differences' rounding grows with the stage, so a small cut path can hide",
                    if train { "training" } else { "evaluation" }
                )))
            }
        }
    }

    /// [`CandleModel::test_weight`]'s tests with the reruns `r`, of the
    /// weight `w` (of scale `rms`) whose backward is `seen`.
    fn test_in(&self, r: Rerun<'_>, seen: &Seen, w: &Tensor, rms: f64) -> Result<()> {
        let Rerun { target, train, dtype, .. } = r;
        let stage = self.probe_stage(target.owner)?;
        let info = &stage.params[target.param];
        let (eps, h0) = if dtype == DType::F64 { (EPS64, 1e-4 * rms) } else { (EPS32, 1e-2 * rms) };
        let mode = if train { "training" } else { "evaluation" };
        let zeros: Vec<usize> = seen.zero.iter().enumerate().filter(|&(_, &z)| z).map(|(j, _)| j).collect();
        if !zeros.is_empty() {
            // Move the zero-gradient elements by a tenth of the weight's scale.
            let mut v = with_values(w, <[f64]>::to_vec)?;
            let key = stream_seed(PROBE_SEED, &[3, target.owner as u64, target.param as u64]);
            for (&j, u) in zeros.iter().zip(noise(key, zeros.len(), 1.0)) {
                v[j] += 0.1 * rms * f64::from(u.signum());
            }
            let moved = Tensor::from_vec(v, info.shape.as_slice(), &Device::Cpu)?.to_dtype(dtype)?;
            let (change, scale) = self.output_change(r, &moved)?;
            // Rounding moves an output by a few roundoffs of its scale; a real use by far more.
            if change > DEPTH * eps * 8.0 * scale.max(1e-30) {
                return Err(CandleError::PartialGradient {
                    stage: stage.name.clone(),
                    param: info.name.clone(),
                    shape: info.shape.clone(),
                    zeros: format!("{} (in {mode} mode)", describe(&zeros, &info.shape)),
                });
            }
        }
        let dir = self.direction(target.owner, target.param, train)?;
        let backward = seen.dot;
        let mut last = 0.0;
        for h in [h0, h0 / 8.0] {
            let (differences, size) = self.differences(r, w, &dir, h)?;
            // The differences: each evaluation of F off by at most DEPTH roundings of
            // Σ|out ⊙ up|. The backward: each gradient element off by DEPTH roundings of
            // f32, independently (a shared factor's error is relative to `backward`).
            let rounding = DEPTH * eps * size / h + DEPTH * EPS32 * (backward.abs() + seen.sq.sqrt());
            let gap = (differences - backward).abs();
            if gap <= DIRECTION_TOL * differences.abs().max(backward.abs()) + rounding {
                return Ok(());
            }
            last = differences;
        }
        Err(CandleError::WrongGradient {
            stage: stage.name.clone(),
            param: info.name.clone(),
            backward,
            differences: last,
        })
    }

    /// Differences of the objective along `dir` with step `h` (one-sided in
    /// f64, central in f32): the moved weight made on the host, one at a time
    /// (the only copy beside the held stage), in `dtype`, divided by the step
    /// actually taken after rounding to `dtype`.
    fn differences(&self, r: Rerun<'_>, w: &Tensor, dir: &[f32], h: f64) -> Result<(f64, f64)> {
        let Rerun { target, train, walk, dtype } = r;
        let shape = self.probe_stage(target.owner)?.params[target.param].shape.clone();
        let moved = |sign: f64| -> Result<(Tensor, f64)> {
            with_values(w, |w| -> Result<(Tensor, f64)> {
                // Σ moved_j · dir_j, in f64 of the values as `dtype` rounds them.
                let (t, along) = if dtype == DType::F64 {
                    let v: Vec<f64> = w.iter().zip(dir).map(|(&a, &u)| a + sign * h * f64::from(u)).collect();
                    let along = v.iter().zip(dir).map(|(&a, &u)| a * f64::from(u)).sum();
                    (Tensor::from_vec(v, shape.as_slice(), &Device::Cpu)?, along)
                } else {
                    let v: Vec<f32> =
                        w.iter().zip(dir).map(|(&a, &u)| (a + sign * h * f64::from(u)) as f32).collect();
                    let along = v.iter().zip(dir).map(|(&a, &u)| f64::from(a) * f64::from(u)).sum();
                    (Tensor::from_vec(v, shape.as_slice(), &Device::Cpu)?, along)
                };
                Ok((t, along))
            })?
        };
        let norm: f64 = dir.iter().map(|&u| f64::from(u) * f64::from(u)).sum::<f64>().max(f64::MIN_POSITIVE);
        let (plus, along_plus) = moved(1.0)?;
        let (fp, sp) = self.objective(r, &plus)?;
        drop(plus);
        if dtype == DType::F64 {
            // One-sided in f64, against F at the held weights (once per set of users
            // and mode): one rerun per weight; its truncation, ~h/rms = 1e-4 of the
            // derivative, is far inside the tolerance.
            let key = (target.users.clone(), train);
            let base = walk.bases.borrow().get(&key).copied();
            let (f0, s0) = match base {
                Some(b) => b,
                None => {
                    let held = walk
                        .weights
                        .get(&target.owner)
                        .and_then(|ws| ws.get(target.param))
                        .ok_or_else(|| CandleError::Config("gradient check: a held weight is gone".into()))?
                        .clone();
                    let b = self.objective(r, &held)?;
                    walk.bases.borrow_mut().insert(key, b);
                    b
                }
            };
            let along_w =
                with_values(w, |w| w.iter().zip(dir).map(|(&a, &u)| a * f64::from(u)).sum::<f64>())?;
            let taken = (along_plus - along_w) / norm;
            return Ok(((fp - f0) / taken, sp.max(s0)));
        }
        // Central in f32, where the truncation of one side would be a percent.
        let (minus, along_minus) = moved(-1.0)?;
        let (fm, sm) = self.objective(r, &minus)?;
        let taken = (along_plus - along_minus) / norm;
        Ok(((fp - fm) / taken, sp.max(sm)))
    }
}

/// Calls `f` with the values of `t`, an f64 tensor on the CPU, read in place
/// (no copy: the weight under test is the largest thing the check holds).
fn with_values<R>(t: &Tensor, f: impl FnOnce(&[f64]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match (&*storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(candle_core::CpuStorage::F64(v)), Some((a, b))) => Ok(f(&v[a..b])),
        _ => Err(CandleError::Config("gradient check: a held weight is not a contiguous f64 tensor".into())),
    }
}
