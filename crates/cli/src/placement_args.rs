//! Placement flags shared by run, serve and fit (placeholder).
