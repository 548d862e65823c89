//! One optimizer step ([`ZeroEngine::train_step`]) and an evaluation: the
//! micro-batches' forward and backward with the gradient reduce of every layer,
//! the global norm and skip decision, clipping and AdamW.

use zeropp_comm::{CommError, CommExt, Communicator, Group};

use super::layer_comm::{PendingGather, Prefetcher};
use super::{Inject, StepOutcome, StepTimes, ZeroEngine, tags};
use crate::EngineError;
use crate::model::{Batch, Model};
use crate::optim::clip_factor;

/// A bucket of [`StepTimes`].
#[derive(Debug, Clone, Copy)]
pub(super) enum Lap {
    Compute,
    Comm,
    Optim,
}

/// Replaces every non-finite value of `grad` by zero; true when there was one.
fn sanitize(grad: &mut [f32]) -> bool {
    if grad.iter().all(|g| g.is_finite()) {
        return false;
    }
    grad.iter_mut().filter(|g| !g.is_finite()).for_each(|g| *g = 0.0);
    true
}

/// The sum over `group` of one f64 per rank, identical on every rank: an
/// all-gather of the 8-byte values, summed in group order (NaN and infinities
/// propagate). Sends 8 bytes to each other member.
fn global_sum_f64<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    value: f64,
) -> Result<f64, CommError> {
    let mut all = vec![0.0f64; group.size()];
    comm.all_gather(group, &[value], &mut all)?;
    Ok(all.iter().sum())
}

impl<M: Model> ZeroEngine<'_, M> {
    /// Adds the time since `since` to `lap`; returns now.
    pub(super) fn lap(&mut self, since: std::time::Instant, lap: Lap) -> std::time::Instant {
        let now = std::time::Instant::now();
        let dt = now.duration_since(since).as_secs_f64();
        match lap {
            Lap::Compute => self.times.compute_s += dt,
            Lap::Comm => self.times.comm_s += dt,
            Lap::Optim => self.times.optim_s += dt,
        }
        now
    }

    /// Sets the padding of bucket `b`'s reduced gradient shard to zero.
    fn zero_padding(&self, b: usize, shard: &mut [f32]) {
        for r in self.padding.get(b).into_iter().flatten() {
            if let Some(x) = shard.get_mut(r.clone()) {
                x.fill(0.0);
            }
        }
    }

    /// Mean loss of `batch` (this rank's share of an evaluation batch), forward only.
    pub fn evaluate<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        prefetch: Option<&mut Prefetcher>,
        batch: &Batch,
    ) -> Result<f32, EngineError> {
        self.comms.start_step(self.steps, false);
        let tape = self.forward_pass(comm, prefetch, batch, None)?;
        comm.traffic_mut().set_op(tags::OTHER);
        Ok(self.model.loss(&tape))
    }

    /// Test hook: injects `fault` into the next [`Self::train_step`] only (it is
    /// cleared when that step starts). Normal runs never call it.
    pub fn inject_fault(&mut self, fault: Inject) {
        self.inject = fault;
    }

    /// One optimizer step over this rank's `micro_batches` (one per gradient
    /// accumulation step). Every rank must call it with the same number of
    /// micro-batches; `prefetch` (a [`Prefetcher`] on a duplicated communicator)
    /// overlaps the next layer's gather (forward and backward) with compute.
    pub fn train_step<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        mut prefetch: Option<&mut Prefetcher>,
        micro_batches: &[Batch],
    ) -> Result<StepOutcome, EngineError> {
        let inject = std::mem::take(&mut self.inject);
        if micro_batches.is_empty() {
            return Err(EngineError::InvalidBatch("a step needs at least one micro-batch".into()));
        }
        let model = self.model;
        let n = self.num_layers();
        self.comms.start_step(self.steps, true);
        self.start_delta_step();
        self.times = StepTimes::default();
        let quant_before = comm.traffic().quant_time();
        let prefetched_before = self.prefetched;
        let mut loss_sum = 0.0f32;
        // Set when this rank's local gradient (before any reduce) held a NaN or an
        // infinity: the non-finite values are replaced by zeros so the collectives
        // (and their quantizers, which reject non-finite input) run normally on
        // every rank, and the flag travels in the norm exchange below, so that all
        // ranks agree to skip the step.
        let mut non_finite = false;
        for (mi, batch) in micro_batches.iter().enumerate() {
            let mut tape =
                self.forward_pass(comm, prefetch.as_deref_mut(), batch, Some((self.steps as u64, mi)))?;
            if inject == Inject::FailMidStep && mi == 0 {
                return Err(EngineError::Training("injected failure in the middle of a step".into()));
            }
            loss_sum += model.loss(&tape);
            // Backward: while layer l computes, the prefetch stream gathers layer
            // l-1 (from the hpZ secondary shards when they exist).
            let mut pending: Option<(usize, PendingGather)> = None;
            let mut persist_grad: Option<Vec<f32>> = None;
            for l in (0..n).rev() {
                let t = std::time::Instant::now();
                let full = match pending.take() {
                    Some((pl, p)) if pl == l => p.wait()?.0,
                    _ if !self.gathered(l) => Vec::new(),
                    _ => self.gather_backward(comm, l)?,
                };
                if let Some(pf) = prefetch.as_deref_mut()
                    && l > 0
                    && self.may_prefetch(l, l - 1)
                {
                    pending = Some((l - 1, self.prefetch_backward(pf, l - 1)?));
                    self.prefetched += 1;
                }
                let t = self.lap(t, Lap::Comm);
                let mut grad = vec![0.0f32; full.len()];
                let layout = self.plan.bucket(l)?;
                if self.placement.has_persistent(l) {
                    let mut compact = vec![0.0f32; model.layers()[l].numel()];
                    model.backward(l, &self.model_view(l, &full)?, &mut tape, &mut compact)?;
                    let pb = self.placement.persistent.unwrap_or(l);
                    let persistent = self.plan.bucket(pb)?;
                    let pgrad = persist_grad.get_or_insert_with(|| vec![0.0f32; persistent.padded_len]);
                    let mut at = 0;
                    for &(b, i) in &self.placement.params[l] {
                        let (dst, slots): (&mut [f32], _) =
                            if b == l { (&mut grad, layout) } else { (pgrad.as_mut_slice(), persistent) };
                        let slot = slots.params.get(i).map(|p| p.range()).unwrap_or_default();
                        let src = compact.get(at..at + slot.len()).unwrap_or_default();
                        if let Some(d) = dst.get_mut(slot) {
                            d.copy_from_slice(src);
                        }
                        at += src.len();
                    }
                } else if layout.is_packed() {
                    let numel = layout.numel;
                    model.backward(l, &full[..numel], &mut tape, &mut grad[..numel])?;
                } else {
                    let mut compact = vec![0.0f32; layout.numel];
                    model.backward(l, &self.model_view(l, &full)?, &mut tape, &mut compact)?;
                    layout.expand_into(&compact, &mut grad)?;
                }
                drop(full);
                if inject == Inject::NanGradient
                    && mi == 0
                    && l == n - 1
                    && let Some(g) = grad.first_mut()
                {
                    *g = f32::NAN;
                }
                non_finite |= sanitize(&mut grad);
                let t = self.lap(t, Lap::Compute);
                if grad.is_empty() {
                    continue;
                }
                comm.traffic_mut().set_op(tags::GRAD_REDUCE);
                let mut shard = vec![0.0f32; self.master[l].len()];
                self.comms.reduce_grads(comm, l, &mut grad, &mut shard)?;
                self.zero_padding(l, &mut shard);
                for (a, g) in self.grad_acc[l].iter_mut().zip(&shard) {
                    *a += g;
                }
                self.lap(t, Lap::Comm);
            }
            // The persistent parameters' gradients, reduced together once per
            // micro-batch (DeepSpeed coalesces small gradients the same way).
            if let (Some(pb), Some(mut grad)) = (self.placement.persistent, persist_grad.take()) {
                let t = std::time::Instant::now();
                non_finite |= sanitize(&mut grad);
                comm.traffic_mut().set_op(tags::GRAD_REDUCE);
                let mut shard = vec![0.0f32; self.master[pb].len()];
                self.comms.reduce_grads(comm, pb, &mut grad, &mut shard)?;
                self.zero_padding(pb, &mut shard);
                for (a, g) in self.grad_acc[pb].iter_mut().zip(&shard) {
                    *a += g;
                }
                self.lap(t, Lap::Comm);
            }
        }
        let accum = micro_batches.len() as f32;
        if micro_batches.len() > 1 {
            for g in self.grad_acc.iter_mut().flatten() {
                *g /= accum;
            }
        }
        // Global gradient norm: every rank all-gathers its local sum of squares in
        // f64 (NaN when its local gradient was non-finite) and sums them in rank
        // order, so every rank gets the same f64 total and the same skip decision.
        let local_sq: f64 = if non_finite {
            f64::NAN
        } else {
            self.grad_acc.iter().flatten().map(|&g| f64::from(g) * f64::from(g)).sum()
        };
        let t = std::time::Instant::now();
        comm.traffic_mut().set_op(tags::GRAD_NORM);
        let total_sq = global_sum_f64(comm, &self.world, local_sq)?;
        let t = self.lap(t, Lap::Comm);
        comm.traffic_mut().set_op(tags::OTHER);
        let norm = total_sq.sqrt() as f32;
        let skipped = !norm.is_finite();
        if skipped {
            self.skipped += 1;
            self.comms.skipped_step();
        } else {
            let factor = clip_factor(norm, self.cfg.gradient_clipping);
            for ((p, g), opt) in self.master.iter_mut().zip(&self.grad_acc).zip(&mut self.optim) {
                opt.step(p, g, factor)?;
            }
        }
        for g in &mut self.grad_acc {
            g.fill(0.0);
        }
        self.lap(t, Lap::Optim);
        if !self.comms.delta_on() {
            // Stale after the update: rebuilt at the next forward gather.
            self.invalidate_secondary();
        } else if skipped {
            // qwZ-Δ keeps its copies across steps; after a skip it rebuilds them.
            self.refresh_next = true;
        }
        self.persist_full = None;
        self.steps += 1;
        let mut times = std::mem::take(&mut self.times);
        times.quant_s = comm.traffic().quant_time().saturating_sub(quant_before).as_secs_f64();
        times.comm_s = (times.comm_s - times.quant_s).max(0.0);
        let prefetched = self.prefetched - prefetched_before;
        Ok(StepOutcome { loss: loss_sum / accum, grad_norm: norm, skipped, times, prefetched })
    }
}
