package main

/*
#include <stdint.h>
*/
import "C"

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/backends/nccl"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/ft"
	"github.com/ftcomm/ftcomm/membership"
)

// ftSettings are ftcomm_ft_new's settings (JSON): ft.Config's fields.
type ftSettings struct {
	Job               string   `json:"job"`
	Group             string   `json:"group"`
	GroupRank         int      `json:"group_rank"`
	GroupSize         int      `json:"group_size"`
	Coordinator       []string `json:"coordinator"`
	Credentials       string   `json:"credentials"` // default $FTCOMM_CREDENTIALS
	Secret            string   `json:"secret"`
	Backend           string   `json:"backend"`
	Device            int      `json:"device"`
	ControlBackend    string   `json:"control_backend"`
	MinReplicas       int      `json:"min_replicas"`
	TimeoutS          float64  `json:"timeout_s"`
	MaxCommitFailures int      `json:"max_commit_failures"`
	RecoveryAddr      string   `json:"recovery_addr"`
	HealChunkSize     int      `json:"heal_chunk_size"`
	HealStreams       int      `json:"heal_streams"`
	DurableCommit     bool     `json:"durable_commit"`
	StallFactor       float64  `json:"stall_factor"`
	StallMinS         float64  `json:"stall_min_s"`
	InitialStep       int64    `json:"initial_step"`
	Spare             bool     `json:"spare"`          // ft.Config.Spare: wait as a warm standby until promoted
	Host              string   `json:"host"`           // ft.Config.Host: placement hint for spares; default the host name
	SnapshotEvery     int      `json:"snapshot_every"` // ft.Config.SnapshotEvery: peer snapshots every K steps (0: off)
	// GroupBackend is the backend of the replica group's data comm
	// (ftcomm_ft_group_comm): "" (the host comm that carries ft's group
	// messages, for CPU tensors) or "nccl" (a comm on Device beside it,
	// for an FSDP shard group on the GPUs).
	GroupBackend  string  `json:"group_backend"`
	DisableHealth bool    `json:"disable_health_watch"`
	LeaseTTLS     float64 `json:"lease_ttl_s"`
	HeartbeatS    float64 `json:"heartbeat_s"`
	Gossip        bool    `json:"gossip"`
	LogLevel      string  `json:"log_level"`
	// nccl data backend
	NCCLLib   string `json:"nccl_lib"`
	CUDARTLib string `json:"cudart_lib"`
}

// groupAbortDelay is the nccl group comm's Config.AbortDelay: how long a
// kernel of a failed shard-group op may wait for a dead rank on a library
// without ncclCommRevoke before ncclCommAbort ends it.
const groupAbortDelay = 2 * time.Second

// maxEvents bounds the events kept for ftcomm_ft_events; older ones are
// dropped (and counted) when the caller does not read them.
const maxEvents = 4096

// ftObj is what an ft handle names.
type ftObj struct {
	c   *ft.Comm
	can *canceler
	dev int // data tensors' device, -1 for host
	// groupDev is the device of the group's data comm (group_backend
	// "nccl"), -1 for host.
	groupDev int
	log      *zap.Logger

	mu      sync.Mutex
	events  []ftEvent
	dropped int64

	// loop is held by the training loop's calls that change what the
	// samplers report (step, commit, sampler_new): one at a time, as
	// ft.Comm wants them, and a sampler's Go object is read by nobody else.
	loop     sync.Mutex
	smu      sync.Mutex
	samplers []*samplerObj // ftcomm_ft_sampler_new's, until freed
}

// lockLoop takes the loop lock, or says that another call of the training
// loop is in progress (ft.Comm's Step and Commit refuse the same).
func (f *ftObj) lockLoop() error {
	if !f.loop.TryLock() {
		return fmt.Errorf("%w: ft: a step, commit or sampler call is in progress on another thread (call them from one thread)", comm.ErrInvalidArgument)
	}
	return nil
}

// refreshSamplers copies each sampler's plan and position for its getters,
// at the end of a step or commit (under the loop lock).
func (f *ftObj) refreshSamplers() {
	f.smu.Lock()
	ss := append([]*samplerObj(nil), f.samplers...)
	f.smu.Unlock()
	for _, s := range ss {
		s.refresh()
	}
}

// ftEvent is an ft.Event as ftcomm_ft_events reports it.
type ftEvent struct {
	Kind         string  `json:"kind"`
	Time         float64 `json:"time"` // Unix seconds
	Epoch        uint64  `json:"epoch"`
	Step         int64   `json:"step"`
	Participants int     `json:"participants"`
	How          string  `json:"how,omitempty"`
	FromStep     int64   `json:"from_step"`
	ToStep       int64   `json:"to_step"`
	Bytes        int64   `json:"bytes"`
	TookS        float64 `json:"took_s"`
	Reason       string  `json:"reason,omitempty"`
	Text         string  `json:"text"`
	Version      uint64  `json:"version,omitempty"` // settings: the version in force from from_step
}

func (f *ftObj) onEvent(e ft.Event) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.events) >= maxEvents {
		f.events = f.events[1:]
		f.dropped++
	}
	f.events = append(f.events, ftEvent{Kind: e.Kind.String(), Time: float64(e.Time.UnixNano()) / 1e9, Epoch: e.Epoch,
		Step: e.Step, Participants: e.Participants, How: e.How, FromStep: e.FromStep, ToStep: e.ToStep,
		Bytes: e.Bytes, TookS: e.Took.Seconds(), Reason: e.Reason, Text: e.String(), Version: e.Version})
}

func (s *ftSettings) config(obj *ftObj) (ft.Config, error) {
	cfg := ft.Config{Job: s.Job, Group: s.Group, GroupRank: s.GroupRank, GroupSize: s.GroupSize,
		Coordinator: s.Coordinator, Credentials: s.Credentials, Secret: []byte(s.Secret), Backend: s.Backend,
		Device: max(s.Device, 0), ControlBackend: s.ControlBackend, MinReplicas: s.MinReplicas, Timeout: seconds(s.TimeoutS),
		MaxCommitFailures: s.MaxCommitFailures, RecoveryAddr: s.RecoveryAddr, HealChunkSize: s.HealChunkSize,
		HealStreams: s.HealStreams, DurableCommit: s.DurableCommit, DisableHealthWatch: s.DisableHealth,
		StallFactor: s.StallFactor, StallMin: seconds(s.StallMinS), InitialStep: s.InitialStep,
		Spare: s.Spare, Host: s.Host, SnapshotEvery: s.SnapshotEvery, Logger: obj.log, OnEvent: obj.onEvent}
	// FT-HSDP shards over comms of its own (FSDP2 over its device mesh):
	// by default the group's one comm is a host comm that carries ft's
	// group messages (and a caller's CPU tensors), with no device comm
	// made for it. With group_backend "nccl" the group gets a data comm on
	// the device beside it: an FSDP shard group with no replica, which ft
	// revokes when a rank of the group dies.
	cfg.GroupBackend = cmp.Or(cfg.ControlBackend, ft.DefaultControlBackend)
	switch s.GroupBackend {
	case "", cfg.GroupBackend:
	case "nccl":
		if s.Device < 0 {
			return cfg, fmt.Errorf("%w: ft: group_backend nccl needs a device (a CUDA ordinal)", comm.ErrInvalidArgument)
		}
		L, err := sharedNCCL(ncclLibraryConfig(s.NCCLLib, s.CUDARTLib))
		if err != nil {
			return cfg, err
		}
		// The shard group's ops run on the training's streams (FSDP's
		// collectives, which the compute stream then waits for): a kernel
		// left waiting for a dead rank must end when ft revokes the comm,
		// or the training's next host sync waits for it. ncclCommRevoke
		// does that where the library has it (RevokeAuto); elsewhere the
		// kernel is aborted AbortDelay after the failure.
		gc := ncclConfigWith(L)
		gc.Revoke, gc.AbortDelay = nccl.RevokeAuto, groupAbortDelay
		cfg.GroupBackend, cfg.GroupBackendConfig = "nccl", gc
	default:
		return cfg, fmt.Errorf("%w: ft: group_backend %q: want \"\" (host) or \"nccl\"", comm.ErrInvalidArgument, s.GroupBackend)
	}
	cfg.Member = membership.DefaultMemberConfig()
	if s.LeaseTTLS > 0 {
		cfg.Member.LeaseTTL = seconds(s.LeaseTTLS)
	}
	if s.HeartbeatS > 0 {
		cfg.Member.HeartbeatInterval = seconds(s.HeartbeatS)
	}
	if s.Gossip {
		g := membership.DefaultGossipConfig()
		cfg.Member.Gossip = &g
	}
	if s.Backend == "nccl" {
		L, err := sharedNCCL(ncclLibraryConfig(s.NCCLLib, s.CUDARTLib))
		if err != nil {
			return cfg, err
		}
		cfg.BackendConfig = ncclConfigWith(L)
	}
	return cfg, cfg.Validate()
}

// ftcomm_ft_new registers this replica with the job's coordinator and
// returns an ft handle (ft.New; interruptible, bounded by timeout_s). A
// slot spare (group_rank -1 with spare) waits here, unbounded, until a
// rank of its group leaves a place free, and takes it.
//
//export ftcomm_ft_new
func ftcomm_ft_new(settings *C.char, out *C.uint64_t) C.int32_t {
	return guard(func() error {
		var s ftSettings
		s.Device = -1
		if err := decode(goString(settings), &s); err != nil {
			return err
		}
		log, err := newLogger(s.LogLevel, "ftcomm.ft")
		if err != nil {
			return err
		}
		obj := &ftObj{can: newCanceler(), dev: -1, groupDev: -1, log: log}
		if s.Backend == "nccl" {
			obj.dev = s.Device
		}
		if s.GroupBackend == "nccl" {
			obj.groupDev = s.Device
		}
		cfg, err := s.config(obj)
		if err != nil {
			obj.can.release()
			return err
		}
		ctx := obj.can.enter()
		defer obj.can.leave()
		limit := 120 * time.Second
		if cfg.Timeout > limit {
			limit = cfg.Timeout
		}
		cancel := context.CancelFunc(func() {})
		if cfg.GroupRank != ft.AnyRank {
			// A slot spare waits for a place as long as it takes
			// (interruptible); a registration is bounded.
			ctx, cancel = context.WithTimeout(ctx, limit)
		}
		defer cancel()
		c, err := ft.New(ctx, cfg)
		if err != nil {
			obj.can.release()
			return interrupted(ctx, err)
		}
		obj.c = c
		*out = C.uint64_t(abi.put(obj))
		return nil
	})
}

// ftcomm_ft_register names count elements of dtype at ptr (device: CUDA
// ordinal, or -1 for host memory) as part of the replica's state, what a
// healing peer receives. Before the first step; the memory must outlive
// the handle.
//
//export ftcomm_ft_register
func ftcomm_ft_register(h C.uint64_t, name *C.char, ptr unsafe.Pointer, count C.int64_t, dtype, device C.int32_t) C.int32_t {
	return guard(func() error {
		f, err := lookup[*ftObj](uint64(h))
		if err != nil {
			return err
		}
		t, err := tensor(ptr, int64(count), int32(dtype), int32(device))
		if err != nil {
			return err
		}
		return f.c.Register(goString(name), t)
	})
}

func (f *ftObj) call(timeoutNs C.int64_t, fn func(ctx context.Context) error) error {
	ctx := f.can.enter()
	defer f.can.leave()
	if timeoutNs > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(timeoutNs))
		defer cancel()
	}
	return interrupted(ctx, fn(ctx))
}

// ftcomm_ft_step starts a step: joins the epoch's quorum, reconfigures,
// heals if behind (ft.Comm.Step; interruptible). A spare's first step
// waits until it is promoted (event "promoted"), then heals. A rollback returns
// FTCOMM_ERR_ROLLED_BACK with the step started (see ft.RollbackError);
// FTCOMM_ERR_FINISHED says a replica ended the run (ft.FinishedError).
//
//export ftcomm_ft_step
func ftcomm_ft_step(h C.uint64_t, timeoutNs C.int64_t) C.int32_t {
	return guard(func() error {
		f, err := lookup[*ftObj](uint64(h))
		if err != nil {
			return err
		}
		if err := f.lockLoop(); err != nil {
			return err
		}
		defer f.loop.Unlock()
		defer f.refreshSamplers()
		return f.call(timeoutNs, f.c.Step)
	})
}

// ftcomm_ft_commit votes on the step and stores 1 in *ok if it committed.
//
//export ftcomm_ft_commit
func ftcomm_ft_commit(h C.uint64_t, timeoutNs C.int64_t, ok *C.int32_t) C.int32_t {
	return guard(func() error {
		f, err := lookup[*ftObj](uint64(h))
		if err != nil {
			return err
		}
		if err := f.lockLoop(); err != nil {
			return err
		}
		defer f.loop.Unlock()
		defer f.refreshSamplers()
		return f.call(timeoutNs, func(ctx context.Context) error {
			c, err := f.c.Commit(ctx)
			*ok = 0
			if c {
				*ok = 1
			}
			return err
		})
	})
}

// ftcomm_ft_finish ends the run at this replica's committed step
// (ft.Comm.Finish): the other replicas' next step fails with
// FTCOMM_ERR_FINISHED. Free the handle after it.
//
//export ftcomm_ft_finish
func ftcomm_ft_finish(h C.uint64_t, timeoutNs C.int64_t) C.int32_t {
	return guard(func() error {
		f, err := lookup[*ftObj](uint64(h))
		if err != nil {
			return err
		}
		return f.call(timeoutNs, f.c.Finish)
	})
}

// ftcomm_ft_refuse refuses a collective of the step that the caller will
// not issue because its own checks found an argument invalid, as
// ftcomm_comm_refuse does on a comm: on the FT data comm, in the op's
// place, so that the other replicas' matching op fails at once
// (FTCOMM_ERR_PEER_REFUSED; on gloo). The failure is recorded for the
// commit. It returns FTCOMM_OK once the refusal is queued.
//
//export ftcomm_ft_refuse
func ftcomm_ft_refuse(h C.uint64_t, kind, root C.int32_t, reason *C.char) C.int32_t {
	return guard(func() error {
		f, err := lookup[*ftObj](uint64(h))
		if err != nil {
			return err
		}
		k, ok := opTypes[int32(kind)]
		if !ok {
			return fmt.Errorf("%w: ftcomm_ft_refuse: op kind %d", comm.ErrInvalidArgument, kind)
		}
		f.c.Refuse(context.Background(), comm.Op{Kind: k, Root: int(root)},
			errors.New(defaultStr(goString(reason), "refused by the caller")))
		return nil
	})
}

// ftcomm_ft_fail_step fails the step in progress for a reason the caller
// found outside ft (ft.Comm.FailStep: a NaN loss, a failed op on a comm of
// its own, a data loader's error): this replica's commit votes no, with
// reason in the "commit failed" event, and its FT comms are revoked at
// once, so that another replica's FT op of the step that needs this
// replica's part fails, and so does its commit. Call it between a step
// and its commit, before issuing the FT collective that would carry what
// is wrong; then call the commit as usual (it stores 0). Outside a started
// step it returns FTCOMM_ERR_INVALID_ARGUMENT and changes nothing; with a
// step or commit running on another thread, FTCOMM_ERR_INVALID_ARGUMENT.
//
//export ftcomm_ft_fail_step
func ftcomm_ft_fail_step(h C.uint64_t, reason *C.char) C.int32_t {
	return guard(func() error {
		f, err := lookup[*ftObj](uint64(h))
		if err != nil {
			return err
		}
		if err := f.lockLoop(); err != nil {
			return err
		}
		defer f.loop.Unlock()
		return f.c.FailStep(goString(reason))
	})
}

// ftcomm_ft_op runs one collective of the step on the FT comm (all-reduce,
// reduce-scatter, all-gather, broadcast or all-to-all; arguments as
// ftcomm_comm_op). Its failure is recorded for the commit; a sync call
// still returns it. With FTCOMM_ASYNC the work handle is stored in *work.
//
//export ftcomm_ft_op
func ftcomm_ft_op(h C.uint64_t, kind C.int32_t, out unsafe.Pointer, outCount C.int64_t, in unsafe.Pointer, inCount C.int64_t,
	dtype, device, redop, root C.int32_t, stream C.uint64_t, timeoutNs C.int64_t, flags C.int32_t, work *C.uint64_t) C.int32_t {
	return guard(func() error {
		f, err := lookup[*ftObj](uint64(h))
		if err != nil {
			return err
		}
		a, err := makeArgs(kind, out, outCount, in, inCount, dtype, device, redop, root, stream, timeoutNs, flags)
		if err != nil {
			if k, ok := opTypes[int32(kind)]; ok && errors.Is(err, comm.ErrInvalidArgument) {
				return f.c.Refuse(context.Background(), comm.Op{Kind: k, Root: int(root)}, err)
			}
			return err
		}
		var issue func(ctx context.Context) *comm.Work
		switch a.kind {
		case opAllReduce:
			issue = func(ctx context.Context) *comm.Work { return f.c.AllReduce(ctx, a.out, a.redop) }
		case opReduceScatter:
			issue = func(ctx context.Context) *comm.Work { return f.c.ReduceScatter(ctx, a.out, a.in, a.redop) }
		case opAllGather:
			issue = func(ctx context.Context) *comm.Work { return f.c.AllGather(ctx, a.out, a.in) }
		case opBroadcast:
			issue = func(ctx context.Context) *comm.Work { return f.c.Broadcast(ctx, a.out, a.root) }
		case opAllToAll:
			issue = func(ctx context.Context) *comm.Work { return f.c.AllToAll(ctx, a.out, a.in) }
		default:
			return fmt.Errorf("%w: ft.Comm has no op of kind %d", comm.ErrInvalidArgument, a.kind)
		}
		// ft's collectives are always async Works: a sync call waits for
		// its Work (on the host: the op is done when the call returns).
		async := a.async
		a.async = true
		wk := newWork(f.can, &a)
		wk.w = issue(wk.ctx)
		if async {
			*work = C.uint64_t(abi.put(wk))
			return nil
		}
		defer wk.release()
		ictx := f.can.enter()
		defer f.can.leave()
		select {
		case <-wk.w.Done():
			return wk.w.Err()
		case <-ictx.Done():
			wk.cancel(ErrInterrupted)
			<-wk.w.Done()
			return fmt.Errorf("%w (op: %v)", ErrInterrupted, wk.w.Err())
		}
	})
}

type ftInfo struct {
	Epoch         uint64 `json:"epoch"`
	Participants  int    `json:"participants"`
	Rank          int    `json:"rank"`
	CommittedStep int64  `json:"committed_step"`
}

// ftcomm_ft_info stores the epoch, participants, this replica's rank in the
// FT comm (-1 while sitting out) and its committed step.
//
//export ftcomm_ft_info
func ftcomm_ft_info(h C.uint64_t, epoch *C.uint64_t, participants, rank *C.int64_t, committed *C.int64_t) C.int32_t {
	return guard(func() error {
		f, err := lookup[*ftObj](uint64(h))
		if err != nil {
			return err
		}
		*epoch = C.uint64_t(f.c.Epoch())
		*participants = C.int64_t(f.c.Participants())
		*rank = C.int64_t(f.c.Rank())
		*committed = C.int64_t(f.c.CommittedStep())
		return nil
	})
}

// ftcomm_ft_group_rank stores this process's rank in its replica group:
// the setting group_rank, or the place a slot spare (group_rank -1 with
// spare) took.
//
//export ftcomm_ft_group_rank
func ftcomm_ft_group_rank(h C.uint64_t, rank *C.int64_t) C.int32_t {
	return guard(func() error {
		f, err := lookup[*ftObj](uint64(h))
		if err != nil {
			return err
		}
		*rank = C.int64_t(f.c.GroupRank())
		return nil
	})
}

// ftcomm_ft_group_comm stores a new comm handle of the replica group's
// data comm of the current epoch (ft.Comm.Group): the shard group of an
// FSDP job with no replica. The comm stays ft's: ft revokes it when a rank
// of the group dies or fails a step, and closes it when the group is
// formed again (the handle's ops then fail with FTCOMM_ERR_CLOSED), and
// refuses to have it reconfigured here (FTCOMM_ERR_INVALID_ARGUMENT);
// ftcomm_comm_free frees the handle and leaves the comm open. Between
// step and commit; FTCOMM_ERR_INVALID_ARGUMENT when the replica has no
// group comm (group_size 1, a spare, no group formed).
//
//export ftcomm_ft_group_comm
func ftcomm_ft_group_comm(h C.uint64_t, out *C.uint64_t) C.int32_t {
	return guard(func() error {
		f, err := lookup[*ftObj](uint64(h))
		if err != nil {
			return err
		}
		g := f.c.Group()
		if g == nil {
			return fmt.Errorf("%w: ft: no group comm: the replica group has one rank, this replica is a spare, or its group is not formed (call it between step and commit)", comm.ErrInvalidArgument)
		}
		backend, dev := "gloo", -1
		if g.Backend().Memory() == comm.DeviceMemory {
			backend, dev = "nccl", f.groupDev
		}
		*out = C.uint64_t(abi.put(&commObj{c: g, can: newCanceler(), backend: backend, device: dev, log: f.log, borrowed: true}))
		return nil
	})
}

// ftcomm_ft_events moves the events reported since the last call into
// buf as a JSON object {"events": [...], "dropped": n}; with a buffer too
// small it returns FTCOMM_ERR_SHORT_BUFFER and keeps them.
//
//export ftcomm_ft_events
func ftcomm_ft_events(h C.uint64_t, buf unsafe.Pointer, capacity C.int64_t, n *C.int64_t) C.int32_t {
	return guard(func() error {
		f, err := lookup[*ftObj](uint64(h))
		if err != nil {
			return err
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		evs := f.events
		if evs == nil {
			evs = []ftEvent{}
		}
		if err := putJSON(map[string]any{"events": evs, "dropped": f.dropped}, buf, capacity, n); err != nil {
			return err
		}
		f.events, f.dropped = nil, 0
		return nil
	})
}

// ftSettingsJSON is ft.Comm.Settings as ftcomm_ft_settings reports it.
type ftSettingsJSON struct {
	Version  uint64                        `json:"version"`
	Epoch    uint64                        `json:"epoch"`
	FromStep int64                         `json:"from_step"`
	Values   map[string]membership.Setting `json:"values"`
}

// ftcomm_ft_settings stores the job's settings in force for this
// replica's step (ft.Comm.Settings) in buf as a JSON object {"version",
// "epoch", "from_step", "values": {key: {"type", "value"}}}; with a
// buffer too small it returns FTCOMM_ERR_SHORT_BUFFER.
//
//export ftcomm_ft_settings
func ftcomm_ft_settings(h C.uint64_t, buf unsafe.Pointer, capacity C.int64_t, n *C.int64_t) C.int32_t {
	return guard(func() error {
		f, err := lookup[*ftObj](uint64(h))
		if err != nil {
			return err
		}
		s := f.c.Settings()
		out := ftSettingsJSON{Version: s.Version, Epoch: s.Epoch, FromStep: s.FromStep, Values: s.Values}
		if out.Values == nil {
			out.Values = map[string]membership.Setting{}
		}
		return putJSON(out, buf, capacity, n)
	})
}

// ftcomm_ft_free closes the ft.Comm (it leaves the job; with GPU data it
// waits until no GPU work of it uses the registered tensors) and frees
// the handle.
//
//export ftcomm_ft_free
func ftcomm_ft_free(h C.uint64_t) C.int32_t {
	return guard(func() error {
		f, err := take[*ftObj](uint64(h))
		if err != nil {
			return err
		}
		f.can.release()
		err = f.c.Close()
		f.smu.Lock()
		for _, s := range f.samplers {
			s.close()
		}
		f.samplers = nil
		f.smu.Unlock()
		f.log.Sync()
		return err
	})
}
