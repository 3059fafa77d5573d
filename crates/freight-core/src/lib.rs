//! freight's transfer engine.

pub mod desc;
pub mod error;
pub mod memory;
pub mod metadata;
pub mod plan;
pub mod request;
pub mod wire;

pub use error::{Error, Result};
