//! Slot actions (`POST /slots/{id}?action=save|restore|erase`): what the handle asks the
//! worker thread, which owns the slots, to do with one idle slot's cache.

use tokio::sync::oneshot;

use crate::scheduler::jobs::{SlotActionError, SlotCommand, SlotRequest};
use crate::scheduler::shared::lock;
use crate::scheduler::Scheduler;
use crate::slot_file::SlotState;

impl Scheduler {
    /// Runs `command` on slot `slot` on the worker thread, between two forward passes.
    async fn slot_command<T>(
        &self,
        slot: usize,
        command: impl FnOnce(oneshot::Sender<Result<T, SlotActionError>>) -> SlotCommand,
    ) -> Result<T, SlotActionError> {
        let n_slots = self.config.n_slots.max(1);
        if slot >= n_slots {
            return Err(SlotActionError::NoSuchSlot { n_slots });
        }
        let (tx, rx) = oneshot::channel();
        {
            let mut q = lock(&self.shared.queue);
            if q.shutdown {
                return Err(SlotActionError::ShuttingDown);
            }
            q.commands.push_back(SlotRequest {
                slot,
                command: command(tx),
            });
        }
        self.shared.wake.notify_one();
        rx.await.unwrap_or(Err(SlotActionError::ShuttingDown))
    }

    /// The tokens and K/V of idle slot `slot`.
    pub async fn save_slot(&self, slot: usize) -> Result<SlotState, SlotActionError> {
        self.slot_command(slot, SlotCommand::Save).await
    }

    /// Replaces idle slot `slot`'s cache with `state`; returns the tokens restored. On any
    /// error the slot is left empty and usable.
    pub async fn restore_slot(
        &self,
        slot: usize,
        state: SlotState,
    ) -> Result<usize, SlotActionError> {
        self.slot_command(slot, |tx| SlotCommand::Restore(Box::new(state), tx))
            .await
    }

    /// Empties idle slot `slot`'s cache; returns the tokens it held.
    pub async fn erase_slot(&self, slot: usize) -> Result<usize, SlotActionError> {
        self.slot_command(slot, SlotCommand::Erase).await
    }
}
