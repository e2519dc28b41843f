package main

import (
	"strings"

	"github.com/ftcomm/ftcomm/comm"
)

// opSpec describes one benchmarked collective: how a requested size maps to
// element counts, and nccl-tests' bus-bandwidth factor.
type opSpec struct {
	name    string
	reduces bool // takes a reduction (-o)
	rooted  bool // has a root (-r)
	// perRank: the requested size is the total across ranks, split into
	// Size() blocks (allgather, reducescatter, alltoall); count is a block.
	perRank bool
	// busFactor converts algorithm bandwidth to bus bandwidth for n ranks,
	// as nccl-tests defines it (doc/PERFORMANCE.md there).
	busFactor func(n int) float64
}

var ops = []opSpec{
	{name: "allreduce", reduces: true, busFactor: func(n int) float64 { return 2 * float64(n-1) / float64(n) }},
	{name: "allgather", perRank: true, busFactor: nMinus1OverN},
	{name: "reducescatter", reduces: true, perRank: true, busFactor: nMinus1OverN},
	{name: "broadcast", rooted: true, busFactor: one},
	{name: "reduce", reduces: true, rooted: true, busFactor: one},
	{name: "alltoall", perRank: true, busFactor: nMinus1OverN},
	{name: "sendrecv", busFactor: one},
}

func nMinus1OverN(n int) float64 { return float64(n-1) / float64(n) }
func one(int) float64            { return 1 }

// rawOp names the raw TCP baseline rows.
const rawOp = "rawtcp"

// rawBusFactor: the baseline moves the bytes of a ring allreduce.
func rawBusFactor(n int) float64 { return ops[0].busFactor(n) }

func opNames() []string {
	out := make([]string, len(ops))
	for i, o := range ops {
		out[i] = o.name
	}
	return out
}

func lookupOp(name string) (opSpec, error) {
	for _, o := range ops {
		if o.name == name {
			return o, nil
		}
	}
	return opSpec{}, usagef("unknown op %q (want %s or all)", name, strings.Join(opNames(), ", "))
}

func canonOp(s string) (string, error) {
	o, err := lookupOp(strings.ToLower(s))
	return o.name, err
}

func canonDType(s string) (string, error) {
	d, err := comm.ParseDType(s)
	if err != nil {
		return "", usagef("-d: %v", err)
	}
	return d.String(), nil
}

func canonRedOp(s string) (string, error) {
	r, err := comm.ParseReduceOp(s)
	if err != nil {
		return "", usagef("-o: %v", err)
	}
	return r.String(), nil
}

// geometry is the shape of one row: count elements per rank block and the
// byte size nccl-tests prints in its first column.
type geometry struct {
	Count int   // elements: of the buffer, or of one rank's block for perRank ops
	Bytes int64 // the size column: Count*elem, times n for perRank ops
}

// geometryOf rounds the requested size down to whole elements (and whole
// blocks of n for perRank ops), as nccl-tests does.
func geometryOf(o opSpec, requested int64, dt comm.DType, n int) geometry {
	e := int64(dt.Size())
	if o.perRank {
		c := requested / (e * int64(n))
		return geometry{Count: int(c), Bytes: c * e * int64(n)}
	}
	c := requested / e
	return geometry{Count: int(c), Bytes: c * e}
}

// bandwidth returns nccl-tests' algbw and busbw in GB/s (1e9 bytes) for a
// row of bytes that took usec microseconds per iteration.
func bandwidth(bytes int64, usec float64, busFactor float64) (algbw, busbw float64) {
	if usec <= 0 {
		return 0, 0
	}
	algbw = float64(bytes) / (usec * 1e-6) / 1e9
	return algbw, algbw * busFactor
}

// combo is one (op, dtype, redop) series of rows.
type combo struct {
	Op    opSpec
	DType comm.DType
	Red   comm.ReduceOp // 0 for ops that do not reduce
}

// plan lists the series in run order: ops, then dtypes, then reductions.
// Non-reducing ops run once per dtype; combinations comm does not define
// (avg on integers) are left out.
func (c *Config) plan() []combo {
	var out []combo
	for _, on := range c.Ops {
		o, err := lookupOp(on)
		if err != nil {
			continue
		}
		for _, dn := range c.DTypes {
			dt, err := comm.ParseDType(dn)
			if err != nil {
				continue
			}
			if !o.reduces {
				out = append(out, combo{Op: o, DType: dt})
				continue
			}
			for _, rn := range c.RedOps {
				r, err := comm.ParseReduceOp(rn)
				if err != nil || !r.Supports(dt) {
					continue
				}
				out = append(out, combo{Op: o, DType: dt, Red: r})
			}
		}
	}
	return out
}

// rawSeries is the index of the series the raw baseline is interleaved
// with: the first allreduce series if there is one, else the first.
func rawSeries(p []combo) int {
	for i, s := range p {
		if s.Op.name == "allreduce" {
			return i
		}
	}
	return 0
}
