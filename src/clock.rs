//! The wall clock as the project's records and messages carry it:
//! milliseconds since the Unix epoch (issue times, deadlines, seals, the
//! ledger's records), read in this one place.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, now (0 for a clock set before it).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
