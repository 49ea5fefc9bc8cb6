//! What every route handler shares: the configuration and the models.

use std::sync::Arc;

use crate::config::ServerConfig;
use crate::parsed_body::ParseBudget;
use crate::registry::Registry;

/// What every handler shares.
pub struct AppState {
    /// The configuration.
    pub config: Arc<ServerConfig>,
    /// The models.
    pub registry: Registry,
    /// Large request bodies parsed at once.
    pub bodies: ParseBudget,
}
