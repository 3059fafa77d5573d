//! CUDA, loaded at run time: the driver API and NVRTC come from the machine's libraries
//! through `cudarc`'s dynamic loading, so one build runs everywhere and uses a GPU only
//! where one is present. Nothing here links against CUDA.
//!
//! - [`driver`]: loading, typed errors, devices and their primary contexts, streams, events.
//! - [`nvrtc`]: compiling CUDA C++ at run time and loading the result, once per GPU.
//! - [`kernel`]: the batched copy kernel, compiled by NVRTC once per GPU architecture.
//! - [`ipc`]: exporting device memory to same-host peers and opening theirs.
//! - [`pinned`]: page-locking host memory so that GPUs can reach it at PCIe speed.
//! - [`flags`]: words in host memory that short kernels write when they finish.
//! - [`completion`]: one thread that turns finished GPU work into finished requests.
//! - [`tables`]: the copy kernel's work tables in GPU memory, reused across requests.
//! - [`bounce`]: pinned bounce buffers, where GPU memory must pass through host memory.

pub mod bounce;
pub mod completion;
pub mod driver;
pub mod flags;
pub mod ipc;
pub mod kernel;
pub mod nvrtc;
pub mod pinned;
pub mod tables;

pub use driver::{available, unavailable_reason, Device};
