package ft

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/recovery"
)

// form forms one dimension's comms for a formComms action: shrinks or
// grows the comms of epoch a.from (taken from the driver: a failed Shrink
// or Grow gives them back as they were), or creates new ones. With a
// device data backend the control comm runs on the control backend beside
// it, formed the same way. Forming is bounded by the op timeout: a rank
// that chose differently must not hold the others forever.
func (d *driver) form(a formComms) {
	t := formTask{formComms: a, d: d, oldKey: commKey{a.dim, a.from}, store: d.m.Store(), prefix: d.prefix(a.dim)}
	if !a.how.fresh() {
		t.old = d.comms[t.oldKey]
		delete(d.comms, t.oldKey)
	}
	d.spawn(a.task, t.run)
}

// formTask is the formation's task. Unlike the other tasks it works on
// the driver's formation fields (split, blobs, copier, staging) and its
// config: the machine runs no other task beside it.
type formTask struct {
	formComms
	d      *driver
	oldKey commKey
	old    comms
	store  comm.Store
	prefix string
}

func (t formTask) run(ctx context.Context) taskResult {
	d := t.d
	tctx, cancel := context.WithTimeout(ctx, d.cfg.Timeout)
	defer cancel()
	x, failed, err := d.formDim(tctx, t.formComms, t.old, t.store, t.prefix)
	if err == nil && t.dim == dimFT {
		if err = d.prepareState(x.data); err != nil {
			x.close()
			x = comms{}
		}
	}
	r := taskResult{key: commKey{t.dim, t.epoch}, formed: x, oldKey: t.oldKey,
		in: commsFormed{task: t.task, dim: t.dim, epoch: t.epoch, split: x.ok() && x.ctl != x.data, failed: failed, err: err}}
	if err != nil && !t.how.fresh() {
		r.old = t.old // as a failed Shrink or Grow left it: the machine closes it
	}
	return r
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

// prefix is where dim's comms rendezvous in the job's store.
func (d *driver) prefix(dm dim) string {
	if dm == dimGroup {
		return "group-" + d.cfg.Group
	}
	return "ft-" + strconv.Itoa(d.cfg.GroupRank)
}

// forgetRendezvous deletes the rendezvous keys of an epoch's comms of a
// dimension, data and control.
func (d *driver) forgetRendezvous(a forgetRendezvous) {
	d.report(rendezvousKeys{prefix: d.prefix(a.dim), epoch: a.epoch})
}

// rendezvousKeys are the keys one epoch's comms of a dimension met under.
type rendezvousKeys struct {
	prefix string
	epoch  uint64
}

func (rendezvousKeys) what() string { return "deleting old rendezvous keys" }
func (k rendezvousKeys) send(ctx context.Context, m *member) error {
	var errs []error
	for _, p := range []string{k.prefix, k.prefix + "-ctl"} {
		errs = append(errs, m.Store().DeletePrefix(ctx, fmt.Sprintf("%s/epoch/%d/", p, k.epoch)))
	}
	return errors.Join(errs...)
}
