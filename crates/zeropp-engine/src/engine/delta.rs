//! qwZ-Δ inside the engine: when a step refreshes the hpZ copies, how a
//! forward gather brings a layer's copy up to date with its difference, what a
//! gather leaves behind (the copy, and this rank's `Ŵ`), and the invariant the
//! tests check: every copy holds exactly what the owners hold.

use zeropp_comm::{CommExt, Communicator, Group};

use super::layer_comm::Secondary;
use super::{ZeroEngine, tags};
use crate::EngineError;
use crate::model::Model;

impl<M: Model> ZeroEngine<'_, M> {
    /// qwZ-Δ at the start of step `step`: a full refresh (the copies dropped, so
    /// the forward gathers rebuild them) when one is due, else every copy waits
    /// for its difference.
    pub(super) fn start_delta_step(&mut self) {
        if !self.comms.delta_on() {
            return;
        }
        let every = self.cfg.zero.qwz_delta.map_or(0, |d| d.refresh_every);
        if self.refresh_next || (every > 0 && self.steps.is_multiple_of(every)) {
            self.invalidate_secondary();
        }
        self.refresh_next = false;
        self.synced.iter_mut().for_each(|s| *s = false);
    }

    /// Whether layer `l`'s forward gather is a qwZ-Δ difference step (a copy is
    /// held but not yet brought up to date this step).
    pub(super) fn needs_delta(&self, l: usize, eval: bool) -> bool {
        !eval && self.comms.delta_on() && self.secondary[l].is_some() && !self.synced[l]
    }

    /// The difference of layer `l`, encoded (this rank's `Ŵ` updated).
    pub(super) fn encode_delta<C: Communicator + ?Sized>(
        &mut self,
        comm: &mut C,
        l: usize,
    ) -> Result<Vec<u8>, EngineError> {
        let w_hat = self.w_hat[l].as_mut().ok_or_else(|| {
            EngineError::Training(format!(
                "qwZ-delta: layer {l} has an hpZ copy but no reconstruction of its own"
            ))
        })?;
        self.comms.delta_encode(comm, &self.master[l], w_hat)
    }

    /// What a forward gather of layer `l` leaves behind: the hpZ copy it kept or
    /// updated (`sec`), and with qwZ-Δ after a full gather, `Ŵ` (the copy's values
    /// of this rank's primary shard).
    pub(super) fn landed(
        &mut self,
        l: usize,
        full: &[f32],
        sec: Option<Secondary>,
        full_gather: bool,
    ) -> Result<(), EngineError> {
        let Some(sec) = sec else { return Ok(()) };
        if self.comms.delta_on() {
            if full_gather {
                let own = self.plan.primary_range(self.rank, l)?;
                self.w_hat[l] = Some(sec.like(full, own)?);
            }
            self.synced[l] = true;
        }
        self.secondary[l] = Some(sec);
        Ok(())
    }

    /// qwZ-Δ's invariant, measured (collective over the world; for tests and
    /// checks, outside the step's traffic): the largest `|copy − Ŵ|` over every
    /// layer and every element of every rank's hpZ copy, `Ŵ` being the owners'
    /// reconstructions gathered over the world in f32. 0 when every copy holds
    /// exactly what its owners hold (and without qwZ-Δ, or before a first step).
    pub fn delta_copy_drift<C: Communicator + ?Sized>(&self, comm: &mut C) -> Result<f64, EngineError> {
        let world = Group::world(comm.topology());
        comm.traffic_mut().set_op(tags::OTHER);
        let mut worst = 0.0f64;
        for l in 0..self.num_layers() {
            let s = self.plan.shard_len(l)?;
            let mine: Vec<f32> = match &self.w_hat[l] {
                Some(w) => w.values(),
                None => vec![0.0; s],
            };
            let mut all = vec![0.0f32; s * world.size()];
            comm.all_gather(&world, &mine, &mut all)?;
            if let (Some(sec), Some(range)) = (&self.secondary[l], self.plan.secondary_range(self.rank, l)?) {
                let owners = all.get(range).unwrap_or_default();
                let copy = sec.values();
                if copy.len() != owners.len() {
                    return Ok(f64::INFINITY);
                }
                for (a, b) in copy.iter().zip(owners) {
                    worst = worst.max((f64::from(*a) - f64::from(*b)).abs());
                }
            }
        }
        let mut all = vec![0.0f64; world.size()];
        comm.all_gather(&world, &[worst], &mut all)?;
        Ok(all.into_iter().fold(0.0, f64::max))
    }
}
