package diloco

import (
	"fmt"
	"math"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
)

// Quantization is how outer gradients travel between replicas.
type Quantization int

const (
	// Float32 sends outer gradients as they are, through one all-reduce.
	Float32 Quantization = iota
	// Int8 sends 8-bit codes with one float32 scale per block of
	// Config.QuantBlock elements, with error feedback.
	Int8
	// Int4 sends 4-bit codes (two per byte) with one float32 scale per
	// block, with error feedback.
	Int4
)

func (q Quantization) String() string {
	switch q {
	case Float32:
		return "float32"
	case Int8:
		return "int8"
	case Int4:
		return "int4"
	}
	return fmt.Sprintf("Quantization(%d)", int(q))
}

// ParseQuantization reads "float32" (or "none", "fp32", ""), "int8" (or
// "8") and "int4" (or "4").
func ParseQuantization(s string) (Quantization, error) {
	switch s {
	case "", "none", "float32", "fp32", "32":
		return Float32, nil
	case "int8", "8":
		return Int8, nil
	case "int4", "4":
		return Int4, nil
	}
	return 0, fmt.Errorf("%w: diloco: quantization %q: want float32, int8 or int4", comm.ErrInvalidArgument, s)
}

// bits is the code width; levels the largest code magnitude.
func (q Quantization) bits() int {
	switch q {
	case Int8:
		return 8
	case Int4:
		return 4
	}
	return 32
}

func (q Quantization) levels() float32 {
	switch q {
	case Int8:
		return 127
	case Int4:
		return 7
	}
	return 0
}

// Config configures DiLoCo. Start from DefaultConfig: zero is a meaningful
// value of Overlap and Alpha.
type Config struct {
	// InnerSteps (H) is the number of inner optimizer steps between two
	// synchronisations of the same parameter.
	InnerSteps int
	// Fragments (F) splits the parameters into F contiguous fragments, one
	// synchronised every H/F inner steps (Streaming DiLoCo); 1 is DiLoCo.
	// H must be divisible by F.
	Fragments int
	// Overlap (τ) is the number of inner steps a fragment's exchange runs
	// behind, before its result is waited for and merged; 0 blocks at the
	// sync. Must be below H/F.
	Overlap int
	// Alpha (α ∈ [0, 1]) mixes a synchronised fragment into the local
	// parameters: local = α·local + (1−α)·global. 0 replaces the local
	// fragment by the new global one (DiLoCo).
	Alpha float64
	// OuterLR and OuterMomentum configure the outer optimizer, SGD with
	// Nesterov momentum (the papers' 0.7 and 0.9).
	OuterLR, OuterMomentum float64
	// Quantization of the outer gradients on the wire.
	Quantization Quantization
	// QuantBlock is the number of elements sharing one scale; default 128.
	QuantBlock int
	// Name prefixes the names registered with the ft.Comm; default "diloco".
	Name string
	// Logger; default none.
	Logger *zap.Logger
}

// DefaultConfig is DiLoCo as published: H = 100 here (the papers use
// 500 on large models), one fragment, no overlap, outer SGD with Nesterov
// momentum, lr 0.7, momentum 0.9, float32 outer gradients.
func DefaultConfig() Config {
	return Config{InnerSteps: 100, Fragments: 1, Overlap: 0, Alpha: 0, OuterLR: 0.7, OuterMomentum: 0.9,
		Quantization: Float32, QuantBlock: 128, Name: "diloco"}
}

// DefaultStreamingConfig is Streaming DiLoCo: four fragments, each
// exchange overlapped with one inner step, mixed in with α = 0.5.
func DefaultStreamingConfig() Config {
	c := DefaultConfig()
	c.Fragments, c.Overlap, c.Alpha = 4, 1, 0.5
	return c
}

// Validate reports what is wrong with c, or nil. Errors wrap
// comm.ErrInvalidArgument.
func (c *Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: diloco: config: "+format, append([]any{comm.ErrInvalidArgument}, args...)...)
	}
	switch {
	case c.InnerSteps < 1:
		return bad("inner steps H = %d: want ≥ 1", c.InnerSteps)
	case c.Fragments < 1:
		return bad("fragments F = %d: want ≥ 1", c.Fragments)
	case c.InnerSteps%c.Fragments != 0:
		return bad("inner steps H = %d is not divisible by fragments F = %d", c.InnerSteps, c.Fragments)
	case c.Overlap < 0 || c.Overlap >= c.InnerSteps/c.Fragments:
		return bad("overlap τ = %d: want 0 ≤ τ < H/F = %d", c.Overlap, c.InnerSteps/c.Fragments)
	case math.IsNaN(c.Alpha) || c.Alpha < 0 || c.Alpha > 1:
		return bad("mixing factor α = %v: want 0 ≤ α ≤ 1", c.Alpha)
	case math.IsNaN(c.OuterLR) || c.OuterLR <= 0 || math.IsInf(c.OuterLR, 0):
		return bad("outer learning rate %v: want > 0", c.OuterLR)
	case math.IsNaN(c.OuterMomentum) || c.OuterMomentum < 0 || c.OuterMomentum >= 1:
		return bad("outer momentum %v: want 0 ≤ momentum < 1", c.OuterMomentum)
	case c.Quantization < Float32 || c.Quantization > Int4:
		return bad("quantization %v: want Float32, Int8 or Int4", c.Quantization)
	case c.QuantBlock < 0 || c.QuantBlock%2 != 0:
		return bad("quantization block %d: want a positive even number (0: default)", c.QuantBlock)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.QuantBlock == 0 {
		c.QuantBlock = 128
	}
	if c.Name == "" {
		c.Name = "diloco"
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}

// Every is H/F: the number of inner steps between two syncs.
func (c *Config) Every() int { return c.InnerSteps / c.Fragments }
