//! The weight gathers of a step: the persistent bucket once per step, each
//! layer for the forward pass (with prefetch, keeping the hpZ secondary shard)
//! and again for the backward pass (from the secondary shards with hpZ), and
//! the model's view of a gathered layer.

use zeropp_comm::Communicator;

use super::layer_comm::{PendingGather, Prefetcher};
use super::step::Lap;
use super::{ZeroEngine, tags};
use crate::EngineError;
use crate::model::{Batch, Model};

impl<M: Model> ZeroEngine<'_, M> {
    /// Gathers the persistent bucket when it is not held (once per step, and
    /// before an evaluation), tagged `tag`.
    pub(super) fn refresh_persistent<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        tag: &str,
    ) -> Result<(), EngineError> {
        let Some(pb) = self.placement.persistent else { return Ok(()) };
        if self.persist_full.is_some() {
            return Ok(());
        }
        comm.traffic_mut().set_op(tag);
        let full = self.comms.gather_persistent(comm, &self.master[pb])?;
        comm.traffic_mut().set_op(tags::OTHER);
        self.persist_full = Some(full);
        Ok(())
    }

    /// Drops the hpZ copies (and qwZ-Δ's `Ŵ`, which describes them).
    pub(super) fn invalidate_secondary(&mut self) {
        for s in &mut self.secondary {
            *s = None;
        }
        for w in &mut self.w_hat {
            *w = None;
        }
    }

    /// The range of layer `l` this rank keeps as its hpZ secondary shard, when a
    /// forward gather (not an evaluation) should keep one.
    pub(super) fn keep_range(
        &self,
        l: usize,
        eval: bool,
    ) -> Result<Option<std::ops::Range<usize>>, EngineError> {
        if eval || self.hpz_group.is_none() {
            return Ok(None);
        }
        Ok(self.plan.secondary_range(self.rank, l)?)
    }

    /// Gathers layer `l` for the forward pass (or evaluation when `eval`): from
    /// the hpZ secondary shards once they exist, else over the world (keeping the
    /// secondary shard).
    pub(super) fn gather_forward<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        l: usize,
        eval: bool,
    ) -> Result<Vec<f32>, EngineError> {
        if !self.gathered(l) {
            return Ok(Vec::new());
        }
        if self.needs_delta(l, eval)
            && let (Some(g), Some(mut sec)) = (self.hpz_group.clone(), self.secondary[l].take())
        {
            let enc = self.encode_delta(comm, l)?;
            let s = self.plan.shard_len(l)?;
            let full = self.comms.delta_gather(comm, &g, &enc, &mut sec, s)?;
            comm.traffic_mut().set_op(tags::OTHER);
            self.landed(l, &full, Some(sec), false)?;
            return Ok(full);
        }
        if !eval && let (Some(g), Some(sec)) = (&self.hpz_group, &self.secondary[l]) {
            comm.traffic_mut().set_op(tags::FWD_GATHER);
            return self.comms.gather_secondary(comm, g, sec);
        }
        comm.traffic_mut().set_op(if eval { tags::EVAL } else { tags::FWD_GATHER });
        let keep = self.keep_range(l, eval)?;
        let (full, sec) = self.comms.gather_weights(comm, &self.master[l], keep)?;
        self.landed(l, &full, sec, true)?;
        Ok(full)
    }

    /// Layer `l`'s parameters back to back, as the model takes them, from the
    /// gathered flat buffer (borrowed when the layout is packed), and the
    /// persistent parameters when the layer has any.
    pub(super) fn model_view<'a>(
        &self,
        l: usize,
        full: &'a [f32],
    ) -> Result<std::borrow::Cow<'a, [f32]>, EngineError> {
        let layout = self.plan.bucket(l)?;
        if self.placement.has_persistent(l) {
            let pb = self.placement.persistent.unwrap_or(l);
            let persistent = self.plan.bucket(pb)?;
            let held = self.persist_full.as_deref().ok_or_else(|| {
                EngineError::CallOrder("persistent parameters used before their gather".into())
            })?;
            let mut out = Vec::with_capacity(self.model.layers()[l].numel());
            for &(b, i) in &self.placement.params[l] {
                let (src, slots) = if b == l { (full, layout) } else { (held, persistent) };
                let part = slots.params.get(i).and_then(|p| src.get(p.range())).ok_or(
                    EngineError::LengthMismatch {
                        what: "gathered layer",
                        expected: slots.padded_len,
                        got: src.len(),
                    },
                )?;
                out.extend_from_slice(part);
            }
            return Ok(std::borrow::Cow::Owned(out));
        }
        if layout.is_packed() {
            let numel = layout.numel;
            full.get(..numel).map(std::borrow::Cow::Borrowed).ok_or(EngineError::LengthMismatch {
                what: "gathered layer",
                expected: numel,
                got: full.len(),
            })
        } else {
            Ok(std::borrow::Cow::Owned(layout.compact(full)?))
        }
    }

    /// Gathers layer `l` for the backward pass.
    pub(super) fn gather_backward<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        l: usize,
    ) -> Result<Vec<f32>, EngineError> {
        comm.traffic_mut().set_op(tags::BWD_GATHER);
        match (&self.hpz_group, &self.secondary[l]) {
            (Some(g), Some(sec)) => self.comms.gather_secondary(comm, g, sec),
            (Some(_), None) => Err(EngineError::Training(format!(
                "hpZ secondary shard of layer {l} missing in backward (forward did not run?)"
            ))),
            _ => Ok(self.comms.gather_weights(comm, &self.master[l], None)?.0),
        }
    }

    /// Submits layer `l`'s backward re-gather to the prefetch stream.
    pub(super) fn prefetch_backward(
        &mut self,
        pf: &mut Prefetcher,
        l: usize,
    ) -> Result<PendingGather, EngineError> {
        match (&self.hpz_group, &self.secondary[l]) {
            (Some(g), Some(sec)) => Ok(self.comms.prefetch_secondary(pf, g, sec, tags::BWD_GATHER)),
            (Some(_), None) => Err(EngineError::Training(format!(
                "hpZ secondary shard of layer {l} missing in backward (forward did not run?)"
            ))),
            _ => Ok(self.comms.prefetch_weights(pf, &self.master[l], None, tags::BWD_GATHER)),
        }
    }

    /// Forward pass of one micro-batch, with prefetch of the next layer's gather
    /// on `prefetch` when given: training micro-batch `micro` of step `step`
    /// for `train_at: Some((step, micro))`, an evaluation for `None`. Returns
    /// the tape.
    pub(super) fn forward_pass<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        mut prefetch: Option<&mut Prefetcher>,
        batch: &Batch,
        train_at: Option<(u64, usize)>,
    ) -> Result<M::Tape, EngineError> {
        let model = self.model;
        let n = self.num_layers();
        let eval = train_at.is_none();
        self.refresh_persistent(comm, if eval { tags::EVAL } else { tags::PERSIST_GATHER })?;
        let mut tape = match train_at {
            None => model.start_eval(batch)?,
            Some((step, micro)) => model.start_train(batch, step, micro)?,
        };
        // Prefetch world gathers of the primary shards and qwZ-Δ's difference
        // steps (both cross nodes); gathers from an up-to-date hpZ copy are
        // intra-node and cheap, they run inline.
        let can_prefetch = |this: &Self, l: usize| {
            eval || this.hpz_group.is_none() || this.secondary[l].is_none() || this.needs_delta(l, eval)
        };
        // (layer, gather, whether it is a full gather)
        let mut pending: Option<(usize, PendingGather, bool)> = None;
        for l in 0..n {
            let t = std::time::Instant::now();
            let full = match pending.take() {
                Some((pl, p, full_gather)) if pl == l => {
                    let (full, sec) = p.wait()?;
                    self.landed(l, &full, sec, full_gather)?;
                    full
                }
                _ => self.gather_forward(comm, l, eval)?,
            };
            if let Some(pf) = prefetch.as_deref_mut()
                && l + 1 < n
                && can_prefetch(self, l + 1)
                && self.may_prefetch(l, l + 1)
            {
                let next = l + 1;
                let p = match (self.needs_delta(next, eval), self.hpz_group.clone()) {
                    (true, Some(g)) => {
                        let enc = self.encode_delta(comm, next)?;
                        let sec = self.secondary[next].take().ok_or_else(|| {
                            EngineError::Training(format!("qwZ-delta: layer {next}'s hpZ copy vanished"))
                        })?;
                        let s = self.plan.shard_len(next)?;
                        (self.comms.prefetch_delta(pf, &g, enc, sec, s)?, false)
                    }
                    _ => {
                        let tag = if eval { tags::EVAL } else { tags::FWD_GATHER };
                        let keep = self.keep_range(next, eval)?;
                        (self.comms.prefetch_weights(pf, &self.master[next], keep, tag), true)
                    }
                };
                self.prefetched += 1;
                pending = Some((next, p.0, p.1));
            }
            let t = self.lap(t, Lap::Comm);
            model.forward(l, &self.model_view(l, &full)?, &mut tape)?;
            drop(full);
            self.lap(t, Lap::Compute);
        }
        if let Some((l, p, full_gather)) = pending {
            let (full, sec) = p.wait()?;
            self.landed(l, &full, sec, full_gather)?;
        }
        Ok(tape)
    }
}
