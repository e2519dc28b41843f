package ft

import (
	"context"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/recovery"
)

// The driver's tasks: each runs on a goroutine of its own (driver.spawn)
// with the comms and values the driver handed it, and returns its result
// as the machine's next input. None reads the driver's state except the
// formation's, which the machine never runs beside another task.

// form forms one dimension's comms for a formComms action: shrinks or
// grows the comms of epoch a.from (taken from the driver: a failed Shrink
// or Grow gives them back as they were), or creates new ones. With a
// device data backend the control comm runs on the control backend beside
// it, formed the same way. Forming is bounded by the op timeout: a rank
// that chose differently must not hold the others forever.
func (d *driver) form(a formComms) {
	oldKey := commKey{a.dim, a.from}
	var old comms
	if !a.how.fresh() {
		old = d.comms[oldKey]
		delete(d.comms, oldKey)
	}
	store := d.m.Store()
	prefix := d.prefix(a.dim)
	d.spawn(a.task, func(ctx context.Context) taskResult {
		tctx, cancel := context.WithTimeout(ctx, d.cfg.Timeout)
		defer cancel()
		x, failed, err := d.formDim(tctx, a, old, store, prefix)
		if err == nil && a.dim == dimFT {
			if err = d.prepareState(x.data); err != nil {
				x.close()
				x = comms{}
			}
		}
		r := taskResult{key: commKey{a.dim, a.epoch}, formed: x, oldKey: oldKey,
			in: commsFormed{task: a.task, dim: a.dim, epoch: a.epoch, split: x.ok() && x.ctl != x.data, failed: failed, err: err}}
		if err != nil && !a.how.fresh() {
			r.old = old // as a failed Shrink or Grow left it: the machine closes it
		}
		return r
	})
}

// keepGroup runs the replica group's vote on keeping the group comms of
// a.epoch into a.into: a rank votes yes while both its group comms are
// healthy. The vote is an all-reduce on the group's control comm, shaped
// unlike the step's own messages there (a mismatch fails it at every
// rank); a rank that formed new comms instead closed these, which fails
// the vote at the others, so every rank ends up forming new ones.
func (d *driver) keepGroup(a keepGroup) {
	x := d.comms[commKey{dimGroup, a.epoch}]
	d.spawn(a.task, func(ctx context.Context) taskResult {
		if !x.ok() || x.ctl.Err() != nil {
			return taskResult{in: groupKept{task: a.task}}
		}
		yes := int64(0)
		if x.data.Err() == nil {
			yes = 1
		}
		tctx, cancel := context.WithTimeout(ctx, d.cfg.Timeout)
		defer cancel()
		v := []int64{yes, int64(a.into), -int64(a.into)}
		err := x.ctl.AllReduce(tctx, comm.Int64s(v), comm.Min)
		return taskResult{in: groupKept{task: a.task, ok: err == nil && v[0] == 1 && v[1] == -v[2], err: err}}
	})
}

// agreeSwitch runs a prepared epoch's agreement on when to move to it:
// the first op on its new control comm at every rank, an all-reduce of
// max over the committed step (read as it is posted: a survivor steps on
// meanwhile), the slowest recent step and the epoch (both ways, so that a
// rank of another epoch fails it). The joiners wait in it until every
// survivor formed the comms in the background.
func (d *driver) agreeSwitch(a agreeSwitch) {
	ctl := d.comms[commKey{dimFT, a.epoch}].ctl
	step := &d.link.step
	timeout := d.cfg.Timeout
	d.spawn(a.task, func(ctx context.Context) taskResult {
		if ctl == nil {
			return taskResult{in: switchAgreed{task: a.task, err: fmt.Errorf("%w: ft: no control comm of epoch %d", comm.ErrClosed, a.epoch)}}
		}
		v := []int64{max(a.step, step.Load()), int64(a.slowest), int64(a.epoch), -int64(a.epoch)}
		err := ctl.AllReduce(ctx, comm.Int64s(v), comm.Max)
		if err == nil && v[2] != -v[3] {
			err = fmt.Errorf("%w: ft: ranks of epochs %d to %d agreeing when to move to epoch %d", comm.ErrMismatch, -v[3], v[2], a.epoch)
		}
		return taskResult{in: switchAgreed{task: a.task, at: switchStep(v[0], time.Duration(v[1]), timeout, a.survivors, a.joiners), err: err}}
	})
}

func (d *driver) formDim(ctx context.Context, a formComms, old comms, store comm.Store, prefix string) (comms, part, error) {
	move := func(x *comm.Comm, prefix, backend string, bcfg any) (*comm.Comm, error) {
		switch a.how {
		case shrinkTo:
			return x.Shrink(ctx, a.exclude, a.epoch)
		case growTo:
			return x.Grow(ctx, a.size, a.epoch)
		}
		return comm.New(ctx, backend, comm.Options{Name: prefix, Rank: a.rank, Size: a.size, Epoch: a.epoch,
			JobID: d.cfg.Job, Secret: d.cfg.Secret, Store: store, Prefix: prefix, Timeout: d.cfg.Timeout,
			Device: d.cfg.Device, Logger: d.log, Metrics: d.metrics.comm, BackendConfig: bcfg})
	}
	backend, bcfg := d.cfg.Backend, d.cfg.BackendConfig
	if a.dim == dimGroup && d.cfg.GroupBackend != "" {
		backend, bcfg = d.cfg.GroupBackend, d.cfg.GroupBackendConfig
	}
	data, err := move(old.data, prefix, backend, bcfg)
	if err != nil {
		return comms{}, partData, err
	}
	d.track(data)
	if !d.splitKnown[a.dim] {
		// The dimension's first formation shows whether its data backend
		// keeps host memory (one comm serves both) or device memory
		// (control needs a host comm beside it). Every rank learns the
		// same.
		d.split[a.dim] = data.Backend().Memory() == comm.DeviceMemory ||
			(d.cfg.ControlBackend != "" && d.cfg.ControlBackend != backend)
		d.splitKnown[a.dim] = true
	}
	if !d.split[a.dim] {
		return comms{ctl: data, data: data}, 0, nil
	}
	ctl, err := move(old.ctl, prefix+"-ctl", d.controlBackend(), d.cfg.ControlBackendConfig)
	if err != nil {
		data.Close()
		return comms{}, partCtl, fmt.Errorf("control comm: %w", err)
	}
	d.track(ctl)
	if ctl.Backend().Memory() != comm.HostMemory {
		data.Close()
		ctl.Close()
		return comms{}, partCtl, fmt.Errorf("%w: ft: control backend %s keeps %s memory; control messages need a host-memory backend (gloo)",
			comm.ErrBackendUnavailable, d.controlBackend(), ctl.Backend().Memory())
	}
	return comms{ctl: ctl, data: data}, 0, nil
}

func (d *driver) controlBackend() string {
	if d.cfg.ControlBackend != "" {
		return d.cfg.ControlBackend
	}
	return DefaultControlBackend
}

// prepareState turns the registered tensors into what recovery serves and
// fills, once the data comm shows which memory the job keeps.
func (d *driver) prepareState(data *comm.Comm) error {
	if d.blobs != nil {
		return nil
	}
	device := data != nil && data.Backend().Memory() == comm.DeviceMemory
	blobs := make([]recovery.Blob, 0, len(d.state))
	for _, r := range d.state {
		switch {
		case !r.t.IsDevice():
			blobs = append(blobs, recovery.Blob{Name: r.name, Data: r.t.Bytes()})
		case data == nil:
			return fmt.Errorf("%w: ft: %q is a device tensor, and no comm of the data backend is formed to copy it", comm.ErrBackendUnavailable, r.name)
		case !device:
			return fmt.Errorf("%w: ft: %q is a device tensor, but backend %s keeps host memory", comm.ErrInvalidArgument, r.name, d.cfg.Backend)
		default:
			if d.copier == nil {
				hc, ok := data.Backend().(comm.HostCopier)
				if !ok {
					return fmt.Errorf("%w: ft: backend %s cannot copy device state to the host (comm.HostCopier), so %q cannot heal",
						comm.ErrBackendUnavailable, d.cfg.Backend, r.name)
				}
				d.copier = hc
				d.staging = newStagingPool(hc, d.cfg.fetchConfig().ChunkSize, stagingBuffers)
			}
			blobs = append(blobs, recovery.Blob{Name: r.name, Mem: &deviceState{copier: d.copier, t: r.t, pool: d.staging}})
		}
	}
	d.blobs = blobs
	return nil
}

// stagingBuffers bounds the pinned host memory a device job's healing uses:
// this many chunk-sized buffers, shared by serving and fetching.
const stagingBuffers = 16

// gather all-gathers the ranks' step records (committed step, the epoch
// that committed it, where the rank serves its state) over the FT control
// comm.
func (d *driver) gather(a gatherRecords) {
	ctl := d.comms[commKey{dimFT, a.epoch}].ctl
	mine := stepRecord{Step: a.step, Epoch: a.last, Addr: d.server.Addr()}
	d.spawn(a.task, func(ctx context.Context) taskResult {
		recs, err := gatherStepRecords(ctx, ctl, mine)
		return taskResult{in: recordsGathered{task: a.task, recs: recs, err: err}}
	})
}

func gatherStepRecords(ctx context.Context, ctl *comm.Comm, mine stepRecord) ([]stepRecord, error) {
	b := make([]byte, stepRecordSize)
	if err := mine.encode(b); err != nil {
		return nil, err
	}
	all := make([]byte, stepRecordSize*ctl.Size())
	if err := ctl.AllGather(ctx, comm.Uint8s(all), comm.Uint8s(b)); err != nil {
		return nil, err
	}
	recs := make([]stepRecord, ctl.Size())
	for r := range recs {
		var err error
		if recs[r], err = decodeStepRecord(all[r*stepRecordSize:]); err != nil {
			return nil, fmt.Errorf("rank %d: %w", r, err)
		}
	}
	return recs, nil
}

// fetch heals: it fetches the agreed step's state from every rank that
// holds it (package recovery). A heal cut short keeps its progress, and
// the next epoch's heal of the same step fetches only the rest.
func (d *driver) fetch(a fetchState) {
	if d.blobs == nil {
		// No comm formed yet (a replica that heals to the run's final
		// state right after it started): host state needs none.
		if err := d.prepareState(nil); err != nil {
			d.later = append(d.later, stateHealed{task: a.task, err: err})
			return
		}
	}
	fc := d.cfg.fetchConfig()
	fc.Progress = &d.healed
	blobs, mt := d.blobs, d.metrics
	d.spawn(a.task, func(ctx context.Context) taskResult {
		st, err := recovery.Fetch(ctx, fc, a.Step, a.Sources, blobs)
		mt.healedBytes.Add(float64(st.Bytes))
		var theirs history
		if err == nil {
			if theirs, err = decodeHistory(st.Meta); err != nil {
				err = fmt.Errorf("the sources' history: %w", err)
			}
		}
		if err == nil {
			mt.healSeconds.Observe(st.Duration.Seconds())
			mt.healThroughput.Set(st.Throughput())
		}
		return taskResult{in: stateHealed{task: a.task, hist: theirs, bytes: st.Bytes, took: st.Duration, err: err}}
	})
}

// record makes the commit of a step durable (DurableCommit): the epoch
// owns the step only if its record is the first. A transient etcd error
// is retried within the op timeout; only "another epoch owns it" is
// final.
func (d *driver) record(a recordCommit) {
	dc := d.m.records
	timeout := d.cfg.Timeout
	d.spawn(a.task, func(ctx context.Context) taskResult {
		rctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		b := backoff.NewExponentialBackOff()
		b.InitialInterval, b.MaxInterval = 10*time.Millisecond, time.Second
		var rec membership.CommitRecord
		var ok bool
		err := backoff.Retry(func() error {
			var err error
			rec, ok, err = dc.RecordCommit(rctx, a.step, a.epoch)
			return err
		}, backoff.WithContext(b, rctx))
		res := commitRecorded{task: a.task, ok: err == nil && ok}
		switch {
		case err != nil:
			res.reason = fmt.Sprintf("recording the commit of step %d: %v", a.step, err)
		case !ok:
			res.reason = fmt.Sprintf("step %d was committed first by epoch %d (%s)", a.step, rec.Epoch, rec.By)
		}
		return taskResult{in: res}
	})
}
