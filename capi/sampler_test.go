package main

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/ft"
)

// Bad sampler settings are refused with a typed error that says what is
// wrong, and register nothing: a later good sampler of the same name is
// made, and a second one of that name is refused.
func TestSamplerSettings(t *testing.T) {
	f := &ftObj{c: &ft.Comm{}}
	for _, c := range []struct{ settings, says string }{
		{``, "Size 0"},
		{`{"size": 10}`, "Batch 0"},
		{`{"size": 10, "batch": 2, "bogus": 1}`, "unknown field"},
		{`{"size": 10, "batch": 2, "seed": -1}`, "seed"},
		{`{"size": 10, "batch": 2, "policy": "sometimes"}`, "batch policy"},
		{`{"size": 10, "batch": 2, "accum": 4, "max_accum": 2}`, "MaxAccum 2 is below Accum 4"},
		{`{"size": 10, "batch": 2, "position": -3}`, "Position -3"},
		{`{"size": 10, "batch": 2`, "unexpected EOF"},
	} {
		_, err := newSampler(f, c.settings)
		if !errors.Is(err, comm.ErrInvalidArgument) || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: %v, want invalid argument saying %q", c.settings, err, c.says)
		}
	}
	if len(f.samplers) != 0 {
		t.Fatalf("bad settings left %d samplers", len(f.samplers))
	}
	o, err := newSampler(f, `{"size": 100, "batch": 4, "position": 250, "policy": "global"}`)
	if err != nil {
		t.Fatal(err)
	}
	if cfg := o.s.Config(); cfg.Name != "data" || cfg.Accum != 1 || cfg.MaxAccum != 4 || cfg.Policy != ft.KeepGlobalBatch {
		t.Errorf("config %+v", cfg)
	}
	if o.position != 250 || o.epoch != 2 || !errors.Is(o.err, ft.ErrNoStep) {
		t.Errorf("before a step: position %d epoch %d err %v", o.position, o.epoch, o.err)
	}
	if _, err := newSampler(f, `{"size": 100, "batch": 4}`); !errors.Is(err, comm.ErrInvalidArgument) || !strings.Contains(err.Error(), "registered twice") {
		t.Errorf("a second sampler named data: %v", err)
	}
	if _, err := newSampler(f, `{"name": "eval", "size": 100, "batch": 4}`); err != nil {
		t.Errorf("a second sampler of another name: %v", err)
	}
	// A closed ft handle: the plan says so; the position stays readable.
	o.close()
	o.refresh()
	if !errors.Is(o.err, ft.ErrClosed) || o.position != 250 {
		t.Errorf("closed: err %v position %d", o.err, o.position)
	}
}

// The sampler's errors: no step is its own kind; a mismatch is an invalid
// argument with its own kind too.
func TestClassifySampler(t *testing.T) {
	info := classify(ft.ErrNoStep)
	if info.Status != errNoStep || !slices.Equal(info.Kinds, []string{"no_step"}) {
		t.Errorf("no step: %+v", info)
	}
	info = classify(&ft.SamplerMismatchError{Name: "data"})
	if info.Status != errInvalidArgument || !slices.Equal(info.Kinds, []string{"invalid_argument", "sampler_mismatch"}) ||
		!strings.Contains(info.Message, `sampler "data"`) {
		t.Errorf("mismatch: %+v", info)
	}
}
