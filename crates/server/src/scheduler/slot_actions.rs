//! Slot actions (`POST /slots/{id}?action=save|restore|erase`): what the handle asks the
//! worker thread, which owns the slots, to do with one idle slot's cache.

use tokio::sync::oneshot;

use crate::error::ApiError;
use crate::scheduler::shared::lock;
use crate::scheduler::Scheduler;
use crate::slot_file::SlotState;

/// What the worker does with a slot.
pub(super) enum SlotCommand {
    /// Its tokens and K/V.
    Save(oneshot::Sender<Result<SlotState, SlotActionError>>),
    /// Replace its cache with a saved one; answers the tokens restored.
    Restore(
        Box<SlotState>,
        oneshot::Sender<Result<usize, SlotActionError>>,
    ),
    /// Empty its cache; answers the tokens it held.
    Erase(oneshot::Sender<Result<usize, SlotActionError>>),
}

/// A command for slot `slot`.
pub(super) struct SlotRequest {
    pub(super) slot: usize,
    pub(super) command: SlotCommand,
}

/// Why a slot action failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotActionError {
    /// No slot of that id.
    #[error("Invalid slot ID: the server has {n_slots} slots (0 to {})", n_slots.saturating_sub(1))]
    NoSuchSlot {
        /// How many slots there are.
        n_slots: usize,
    },
    /// The slot runs a request.
    #[error("slot {0} is processing a request; try again once it is idle")]
    Busy(usize),
    /// The saved K/V does not fit this slot's cache (another context, micro-batch or K/V type).
    #[error("the saved K/V does not fit this slot: {0}")]
    Mismatch(String),
    /// The device has no memory for the K/V now.
    #[error("no device memory for the slot's K/V now ({0}); try again later")]
    OutOfMemory(String),
    /// The device failed.
    #[error("the slot action failed: {0}")]
    Device(String),
    /// The model is being unloaded or the server is stopping.
    #[error("the model is shutting down")]
    ShuttingDown,
}

impl SlotActionError {
    /// The HTTP error it becomes.
    pub fn api_error(&self) -> ApiError {
        match self {
            SlotActionError::NoSuchSlot { .. } | SlotActionError::Mismatch(_) => {
                ApiError::bad_request(self.to_string())
            }
            SlotActionError::Busy(_) => ApiError::conflict(self.to_string()),
            SlotActionError::OutOfMemory(_) | SlotActionError::ShuttingDown => {
                ApiError::unavailable(self.to_string())
            }
            SlotActionError::Device(_) => ApiError::internal(self.to_string()),
        }
    }
}

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
