//! The worker's side of slot actions: save, restore and erase an idle slot's cache.

use hmoe_model::ModelError;

use super::Worker;
use crate::scheduler::jobs::{SlotActionError, SlotCommand, SlotRequest};
use crate::slot_file::SlotState;

impl Worker {
    /// Runs one slot action and answers it (a dropped answer: the client went away).
    pub(super) fn run_command(&mut self, req: SlotRequest) {
        let idle = match self.slots.get(req.slot) {
            None => Err(SlotActionError::NoSuchSlot {
                n_slots: self.slots.len(),
            }),
            Some(s) if s.active.is_some() => Err(SlotActionError::Busy(req.slot)),
            Some(_) => Ok(req.slot),
        };
        // `/slots` shows the slot's new state before the action is answered.
        match req.command {
            SlotCommand::Save(tx) => {
                let saved = idle.and_then(|i| self.save(i));
                self.publish();
                let _ = tx.send(saved);
            }
            SlotCommand::Restore(state, tx) => {
                let restored = idle.and_then(|i| self.restore(i, *state));
                self.publish();
                let _ = tx.send(restored);
            }
            SlotCommand::Erase(tx) => {
                let erased = idle.map(|i| self.erase(i));
                self.publish();
                let _ = tx.send(erased);
            }
        }
    }

    /// The slot's tokens and the K/V of their positions. A cache the device freed to make
    /// room holds nothing: the slot is emptied and saved empty.
    fn save(&mut self, slot: usize) -> Result<SlotState, SlotActionError> {
        if !self.model.cache_held(&self.slots[slot].cache) {
            self.erase(slot);
        }
        let s = &self.slots[slot];
        let kv = self.model.export_kv(&s.cache).map_err(device_error)?;
        Ok(SlotState {
            tokens: s.tokens.clone(),
            n_exact: s.n_exact,
            kv,
        })
    }

    /// Puts a saved state into the slot; on failure the slot is left empty.
    fn restore(&mut self, slot: usize, state: SlotState) -> Result<usize, SlotActionError> {
        self.erase(slot);
        let s = &mut self.slots[slot];
        if state.tokens.len() != state.kv.n_past {
            return Err(SlotActionError::Mismatch(format!(
                "{} tokens for {} positions of K/V",
                state.tokens.len(),
                state.kv.n_past
            )));
        }
        if let Err(e) = self.model.import_kv(&mut s.cache, &state.kv) {
            s.cache.clear();
            return Err(match e {
                ModelError::Cache(m) => SlotActionError::Mismatch(m),
                e => device_error(e),
            });
        }
        s.n_exact = state.n_exact.min(state.tokens.len());
        s.tokens = state.tokens;
        s.last_used = self.clock;
        Ok(s.tokens.len())
    }

    /// Empties the slot's cache; returns the tokens it held.
    fn erase(&mut self, slot: usize) -> usize {
        let s = &mut self.slots[slot];
        let n = s.tokens.len();
        s.cache.clear();
        s.tokens.clear();
        s.n_exact = 0;
        n
    }
}

fn device_error(e: ModelError) -> SlotActionError {
    match e.is_out_of_memory() {
        true => SlotActionError::OutOfMemory(e.to_string()),
        false => SlotActionError::Device(e.to_string()),
    }
}
