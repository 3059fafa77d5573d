//! A made transfer: what it moves, along which path, and the program its transport runs
//! each time it is posted (made once). [`super::Agent::make_request`] builds it; the
//! bookkeeping of a round (status, completion, waiting) is [`crate::tracker::Tracker`]'s.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::AgentInner;
use crate::peer::Peer;
use crate::tracker::{Finisher, Status, Tracker};
use crate::transport::cuda::{self as gpu, CudaProgram};
use crate::transport::fabric::{Fabric, FabricProgram};
use crate::transport::gpu_bounce::GpuRegions;
use crate::transport::shm::ShmProgram;
use freight_proto::error::{invalid, Error, Result};
use freight_proto::frame;
use freight_proto::op::OpKind;
use freight_proto::path_choice::{TransferPath, TransportKind};
use freight_proto::plan::{chunk_ops, Chunk, Plan};

/// A transfer that can be posted, polled, waited on and posted again.
pub struct Request {
    pub(super) agent: Arc<AgentInner>,
    pub(super) peer: Arc<Peer>,
    pub(super) op: OpKind,
    pub(super) plan: Arc<Plan>,
    pub(super) notif: Option<Vec<u8>>,
    pub(super) path: TransferPath,
    pub(super) tracker: Arc<Tracker>,
    /// What the request's transport runs each post, made once (see [`Request::program`]).
    pub(super) program: OnceLock<Program>,
}

/// A request made ready for the one transport its path takes.
pub(super) enum Program {
    Shm(Arc<ShmProgram>),
    Cuda(Arc<CudaProgram>),
    Fabric(Arc<FabricProgram>),
    /// The request cut into tcp messages, and the local GPU regions whose bytes are
    /// staged through host memory (`None`: host memory only).
    Tcp {
        chunks: Arc<Vec<Chunk>>,
        local_gpu: Option<Arc<GpuRegions>>,
    },
}

impl Request {
    pub fn path(&self) -> &TransferPath {
        &self.path
    }
    pub fn bytes(&self) -> u64 {
        self.plan.bytes
    }
    pub fn op(&self) -> OpKind {
        self.op
    }
    /// Copies after merging adjacent descriptors.
    pub fn copies(&self) -> usize {
        self.plan.copy_count()
    }
    pub fn status(&self) -> Status {
        self.tracker.status()
    }
    /// How long the last round took, posted to done or failed (`None` while pending).
    pub fn duration(&self) -> Option<Duration> {
        self.tracker.duration()
    }
    /// Waits until done or failed, or `timeout` (then the status is still `Pending`).
    pub fn wait(&self, timeout: Option<Duration>) -> Status {
        self.tracker.wait(timeout)
    }
    /// Runs `hook` once, on the thread that settles the current round, right after the
    /// status became final (at once, here, where it already is). Typically wakes a loop
    /// that keeps many requests in flight, instead of polling their statuses.
    pub fn on_settled(&self, hook: impl FnOnce() + Send + 'static) {
        self.tracker.on_settled(Box::new(hook))
    }

    /// Starts the transfer. Non-blocking, except that small shm transfers complete on
    /// the calling thread (they take less time than handing them over would), and that
    /// for small GPU transfers the calling thread watches for completion for up to
    /// 30 us before leaving it to the agent's completion thread.
    pub fn post(&self) -> Result<()> {
        self.post_notifying(self.notif.clone())
    }

    /// [`Request::post`] with this round's notification in place of the one the request
    /// was made with (`None`: none this round). Later rounds go back to the request's own.
    pub fn post_with_notif(&self, notif: Option<Vec<u8>>) -> Result<()> {
        if notif.as_ref().is_some_and(|m| m.len() > frame::MAX_NOTIF) {
            return Err(invalid(format!("notification larger than {} bytes", frame::MAX_NOTIF)));
        }
        self.post_notifying(notif)
    }

    fn post_notifying(&self, notif: Option<Vec<u8>>) -> Result<()> {
        self.agent.check_open()?;
        self.peer.check_alive()?;
        let mut guards = Vec::with_capacity(self.plan.local_regions.len());
        for &k in &self.plan.local_regions {
            let g = self.agent.served.registry.get(k).ok_or_else(|| {
                Error::InvalidState(format!("local region {k} was deregistered after this request was made"))
            })?;
            guards.push(g);
        }
        let ctx = self.agent.dial_context();
        let control = match (&notif, self.path.transport) {
            // Mapping transports need the control link open: revocations arrive on it.
            (Some(_), _) | (None, TransportKind::Shm | TransportKind::Cuda) => Some(self.peer.control(&ctx)?),
            _ => None,
        };
        let program = self.program(&ctx)?;
        // A one-message tcp write takes its notification along (see `TcpConn::submit`),
        // where the target takes notifications from our outbox: that is what keeps it
        // behind the ones sent before it.
        let rides = matches!(program, Program::Tcp { chunks, .. } if chunks.len() == 1)
            && self.op == OpKind::Write
            && control.as_ref().is_some_and(|c| c.rides_on_data());
        let (notif, riding) = if rides { (None, notif) } else { (notif, None) };
        let finisher: Finisher = Box::new(move |result| {
            drop(guards);
            result?;
            if let (Some(msg), Some(link)) = (notif, control) {
                link.notify(msg)?;
            }
            Ok(())
        });
        match program {
            Program::Cuda(program) => program.execute(&self.tracker, finisher, self.agent.completions()?),
            Program::Shm(program) => self.agent.copy_pool()?.execute(program, self.op, &self.tracker, finisher),
            Program::Fabric(program) => self.agent.fabric()?.execute(program, &self.tracker, finisher),
            Program::Tcp { chunks, local_gpu } => {
                let gpu_place = local_gpu
                    .as_ref()
                    .and_then(|g| g.first())
                    .and_then(|d| freight_host::pci::device(std::path::Path::new("/"), &d.bus_id));
                let conn = self.peer.tcp(&ctx, &self.agent.served.config.tcp, gpu_place)?;
                self.tracker.begin(chunks.len() as u64, finisher)?;
                conn.submit(self.op, chunks.clone(), &self.tracker, local_gpu.clone(), riding);
                Ok(())
            }
        }
    }

    /// The request made ready for its transport: compiled at the first post (at
    /// `make_request` for cuda) and kept. A transport that maps the peer's memory
    /// checks at every post that the peer has not revoked a region the program names.
    pub(super) fn program(&self, ctx: &crate::peer::DialContext) -> Result<&Program> {
        if self.path.transport != TransportKind::Tcp {
            self.check_remote_regions()?;
        }
        if let Some(p) = self.program.get() {
            return Ok(p);
        }
        let program = match self.path.transport {
            TransportKind::Shm => Program::Shm(Arc::new(self.compile_shm()?)),
            TransportKind::Cuda => Program::Cuda(Arc::new(self.compile_cuda()?)),
            TransportKind::Fabric => Program::Fabric(Arc::new(self.compile_fabric(self.agent.fabric()?, ctx)?)),
            TransportKind::Tcp => Program::Tcp {
                chunks: Arc::new(chunk_ops(
                    self.plan.copies(),
                    self.agent.served.config.tcp.chunk_size,
                    frame::MAX_SEGS,
                )),
                local_gpu: self.local_gpu_regions()?,
            },
        };
        Ok(self.program.get_or_init(|| program))
    }

    /// Fails when the peer revoked a region this request writes or reads.
    fn check_remote_regions(&self) -> Result<()> {
        let regions = self.peer.regions.read();
        match self.plan.remote_regions.iter().find(|k| !regions.contains(**k)) {
            Some(k) => Err(Error::RemoteRejected {
                peer: self.peer.name.clone(),
                reason: format!("region {k} was deregistered by its owner"),
            }),
            None => Ok(()),
        }
    }

    fn compile_cuda(&self) -> Result<CudaProgram> {
        // A copy of the regions, not the lock: compiling may load (even build) the
        // kernels, and a revocation waiting for the lock would stall every reader.
        let remote: std::collections::HashMap<u64, freight_proto::region::RegionInfo> = {
            let regions = self.peer.regions.read();
            self.plan.remote_regions.iter().filter_map(|&k| regions.get(k).map(|r| (k, r.clone()))).collect()
        };
        let view = gpu::PeerView {
            cuda: &self.peer.cuda,
            shm: &self.peer.shm,
            same_process: self.peer.same_host && self.peer.md.host.pid == std::process::id(),
        };
        let program = CudaProgram::compile(
            &self.plan,
            self.op,
            |k| self.agent.served.registry.get(k).map(|r| r.info.clone()),
            |k| remote.get(&k).cloned(),
            &view,
            &self.agent.served.config.cuda,
            self.agent.served.id,
        )?;
        // A region revoked while the program was compiled from the copy: the revocation
        // let go of the imports it knew, and the compile may have opened one again since.
        if let Err(e) = self.check_remote_regions() {
            drop(program);
            self.peer.close_imports_of_revoked_regions();
            return Err(e);
        }
        Ok(program)
    }

    fn compile_fabric(&self, fabric: &Arc<Fabric>, ctx: &crate::peer::DialContext) -> Result<FabricProgram> {
        let link = self.peer.fabric(ctx, fabric)?;
        fabric.compile(
            &link,
            &self.plan,
            self.op,
            |k| self.agent.served.registry.get(k).map(|r| (r.info.clone(), r.is_private())),
            |k| self.peer.regions.read().get(k).cloned(),
        )
    }

    /// For tcp: the local GPU regions, whose bytes are staged (`None`: host memory only).
    fn local_gpu_regions(&self) -> Result<Option<Arc<GpuRegions>>> {
        let regions: Vec<_> =
            self.plan.local_regions.iter().filter_map(|&k| self.agent.served.registry.get(k)).collect();
        GpuRegions::of(regions.iter().map(|r| &r.info))
    }

    fn compile_shm(&self) -> Result<ShmProgram> {
        let regions = self.peer.regions.read();
        self.peer.shm.compile(&self.plan, |k| regions.get(k).cloned(), &self.agent.served.config.shm)
    }
}
