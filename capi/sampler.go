package main

// The quorum-aware sampler (ft.Sampler) on an ft handle.

/*
#include <stdint.h>
#include <string.h>
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"sync"
	"unsafe"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/ft"
)

// samplerSettings are ftcomm_ft_sampler_new's settings (JSON):
// ft.SamplerConfig's fields.
type samplerSettings struct {
	Name       string `json:"name"`
	Size       int64  `json:"size"`
	Seed       uint64 `json:"seed"`
	Sequential bool   `json:"sequential"`
	Batch      int    `json:"batch"`
	Accum      int    `json:"accum"`
	Policy     string `json:"policy"`
	MaxAccum   int    `json:"max_accum"`
	Replicas   int    `json:"replicas"`
	Position   int64  `json:"position"`
}

func (s samplerSettings) config() ft.SamplerConfig {
	return ft.SamplerConfig{Name: s.Name, Size: s.Size, Seed: s.Seed, Sequential: s.Sequential, Batch: s.Batch,
		Accum: s.Accum, Policy: ft.BatchPolicy(s.Policy), MaxAccum: s.MaxAccum, Replicas: s.Replicas, Position: s.Position}
}

// samplerObj is what a sampler handle names. The ft.Sampler belongs to the
// training loop: it is read only by the call that ends a Step or a Commit
// (refresh, under the ft handle's loop lock), which copies what the getters
// report into a snapshot; the getters read the snapshot alone, so they are
// safe from any thread at any time.
type samplerObj struct {
	f *ftObj
	s *ft.Sampler

	mu       sync.Mutex
	err      error  // why there is no plan (nil: meta and indices are the step's)
	meta     []byte // the plan without its indices, as JSON
	indices  []int64
	position int64
	epoch    int64
}

// planMeta is a plan as ftcomm_sampler_plan reports it, the indices aside.
type planMeta struct {
	Step         int64       `json:"step"`
	Position     int64       `json:"position"`
	Epoch        int64       `json:"epoch"`
	Samples      int         `json:"samples"`
	Participants int         `json:"participants"`
	Target       int         `json:"target"`
	Policy       string      `json:"policy"`
	LRScale      float64     `json:"lr_scale"`
	Micro        []microMeta `json:"micro"`
}

// microMeta is a micro-batch: its indices are the next Size of the plan's.
type microMeta struct {
	Size   int     `json:"size"`
	Weight float64 `json:"weight"`
}

// refresh copies the sampler's plan and position into the snapshot. On the
// training loop's call only.
func (o *samplerObj) refresh() {
	p, err := o.s.Plan()
	var meta []byte
	var idx []int64
	if err == nil {
		m := planMeta{Step: p.Step, Position: p.Position, Epoch: p.Epoch, Samples: p.Samples,
			Participants: p.Participants, Target: p.Target, Policy: string(p.Policy), LRScale: p.LRScale,
			Micro: make([]microMeta, len(p.Micro))}
		for i, mb := range p.Micro {
			m.Micro[i] = microMeta{Size: len(mb.Indices), Weight: mb.Weight}
		}
		if meta, err = json.Marshal(m); err == nil {
			idx = p.Indices()
		}
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.err == ft.ErrClosed {
		return
	}
	o.err, o.meta, o.indices = err, meta, idx
	o.position, o.epoch = o.s.Position(), o.s.Epoch()
}

// close makes the snapshot say the ft handle was freed.
func (o *samplerObj) close() {
	o.mu.Lock()
	o.err, o.meta, o.indices = ft.ErrClosed, nil, nil
	o.mu.Unlock()
}

// newSampler makes f's sampler from its settings (JSON).
func newSampler(f *ftObj, settings string) (*samplerObj, error) {
	var s samplerSettings
	if err := decode(settings, &s); err != nil {
		return nil, err
	}
	if err := f.lockLoop(); err != nil {
		return nil, err
	}
	defer f.loop.Unlock()
	fs, err := ft.NewSampler(f.c, s.config())
	if err != nil {
		return nil, err
	}
	o := &samplerObj{f: f, s: fs}
	o.refresh()
	f.smu.Lock()
	f.samplers = append(f.samplers, o)
	f.smu.Unlock()
	return o, nil
}

// ftcomm_ft_sampler_new makes the ft handle's sampler of a dataset
// (ft.NewSampler) from settings (JSON: name, size, seed, sequential, batch,
// accum, policy, max_accum, replicas, position; ft.SamplerConfig's fields)
// and returns its handle in *out. Its position is registered as the
// replica's state "ftcomm.sampler/<name>": call it before the first step,
// with the registrations, alike on every replica. Bad settings, a name
// used twice or a call after the first step return
// FTCOMM_ERR_INVALID_ARGUMENT and register nothing.
//
//export ftcomm_ft_sampler_new
func ftcomm_ft_sampler_new(h C.uint64_t, settings *C.char, out *C.uint64_t) C.int32_t {
	return guard(func() error {
		f, err := lookup[*ftObj](uint64(h))
		if err != nil {
			return err
		}
		o, err := newSampler(f, goString(settings))
		if err != nil {
			return err
		}
		*out = C.uint64_t(abi.put(o))
		return nil
	})
}

// ftcomm_sampler_plan reports this rank's plan for the step in progress
// (ft.Sampler.Plan): its meta as JSON into meta (cap metaCap bytes; length
// in *metaN) — {"step", "position", "epoch", "samples", "participants",
// "target", "policy", "lr_scale", "micro": [{"size", "weight"}, …]} — and
// its indices, the micro-batches' one after the other, into the int64
// array indices (cap indicesCap elements; count in *indicesN). With either
// buffer too small it returns FTCOMM_ERR_SHORT_BUFFER with both lengths
// stored and nothing copied. Outside a step it fails with
// FTCOMM_ERR_NO_STEP, while this replica sits out with
// FTCOMM_ERR_NOT_PARTICIPATING, and with FTCOMM_ERR_INVALID_ARGUMENT (kind
// "sampler_mismatch") when the state healed from the job's replicas came
// from a sampler configured otherwise.
//
//export ftcomm_sampler_plan
func ftcomm_sampler_plan(h C.uint64_t, meta unsafe.Pointer, metaCap C.int64_t, metaN *C.int64_t,
	indices *C.int64_t, indicesCap C.int64_t, indicesN *C.int64_t) C.int32_t {
	return guard(func() error {
		o, err := lookup[*samplerObj](uint64(h))
		if err != nil {
			return err
		}
		o.mu.Lock()
		defer o.mu.Unlock()
		if o.err != nil {
			return o.err
		}
		if metaN != nil {
			*metaN = C.int64_t(len(o.meta))
		}
		if indicesN != nil {
			*indicesN = C.int64_t(len(o.indices))
		}
		if int64(len(o.meta)) > int64(metaCap) || int64(len(o.indices)) > int64(indicesCap) {
			return fmt.Errorf("%w: %d bytes of meta and %d indices needed, %d and %d given", errShort,
				len(o.meta), len(o.indices), metaCap, indicesCap)
		}
		if (len(o.meta) > 0 && meta == nil) || (len(o.indices) > 0 && indices == nil) {
			return fmt.Errorf("%w: ftcomm_sampler_plan: a null buffer", comm.ErrInvalidArgument)
		}
		if err := putBytes(o.meta, meta, metaCap, nil); err != nil {
			return err
		}
		if len(o.indices) > 0 {
			C.memcpy(unsafe.Pointer(indices), unsafe.Pointer(unsafe.SliceData(o.indices)), C.size_t(8*len(o.indices)))
		}
		return nil
	})
}

// ftcomm_sampler_position stores the job's position as this replica holds
// it (the samples its committed steps consumed; healed with the model) and
// the dataset epoch of the next sample.
//
//export ftcomm_sampler_position
func ftcomm_sampler_position(h C.uint64_t, position, epoch *C.int64_t) C.int32_t {
	return guard(func() error {
		o, err := lookup[*samplerObj](uint64(h))
		if err != nil {
			return err
		}
		o.mu.Lock()
		defer o.mu.Unlock()
		*position, *epoch = C.int64_t(o.position), C.int64_t(o.epoch)
		return nil
	})
}

// ftcomm_sampler_free frees the sampler handle. The sampler stays part of
// the ft.Comm (its position is registered state, healed with the rest),
// without a handle to read it.
//
//export ftcomm_sampler_free
func ftcomm_sampler_free(h C.uint64_t) C.int32_t {
	return guard(func() error {
		o, err := take[*samplerObj](uint64(h))
		if err != nil {
			return err
		}
		o.f.smu.Lock()
		defer o.f.smu.Unlock()
		for i, x := range o.f.samplers {
			if x == o {
				o.f.samplers = append(o.f.samplers[:i], o.f.samplers[i+1:]...)
				break
			}
		}
		return nil
	})
}
