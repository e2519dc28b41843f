package main

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/ftcomm/ftcomm/backends/nccl"
	"github.com/ftcomm/ftcomm/comm"
)

// errUsage marks a bad command line; main exits 2 for it.
var errUsage = errors.New("ftbench: usage")

func usagef(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{errUsage}, args...)...)
}

// Config is one benchmark run, as the flags describe it. The launcher
// validates it and hands it to every worker unchanged (as JSON), so all
// ranks derive the same plan of rows from it.
type Config struct {
	NP      int      `json:"np"`
	Backend string   `json:"backend"`
	MinSize int64    `json:"min_bytes"`
	MaxSize int64    `json:"max_bytes"`
	Factor  float64  `json:"factor"`     // multiplicative step (-f); used when Step is 0
	Step    int64    `json:"step"`       // additive step in bytes (-i); 0: use Factor
	Ops     []string `json:"ops"`        // collective names, in run order
	DTypes  []string `json:"dtypes"`     // canonical comm dtype names
	RedOps  []string `json:"redops"`     // reduction names
	Root    int      `json:"root"`       // root of broadcast and reduce
	Warmup  int      `json:"warmup"`     // untimed iterations per row
	Iters   int      `json:"iters"`      // timed iterations per row
	Average int      `json:"average"`    // time per row: 0 rank 0, 1 mean, 2 min, 3 max over ranks (nccl-tests -a)
	Raw     bool     `json:"raw"`        // also run the raw TCP ring baseline
	RawBuf  int64    `json:"raw_buf"`    // SO_SNDBUF/SO_RCVBUF of the baseline's sockets; 0: kernel autotuning
	Timeout Duration `json:"timeout"`    // deadline of each op (and of connection setup)
	JSON    bool     `json:"json"`       // machine output instead of the table
	CPUProf string   `json:"cpuprofile"` // worker CPU profile path; ".rank<r>" is appended
	Trace   string   `json:"trace"`      // worker execution trace path; ".rank<r>" is appended
	Verbose bool     `json:"verbose"`    // worker logs at debug level
	// NCCLMode is how the nccl backend uses NCCL comms (nccl.Config.Mode:
	// blocking-data, nonblocking or blocking); empty: the backend's default.
	NCCLMode string `json:"nccl_mode"`
	// GlooLanes bounds the cores a gloo rank spreads a large all-reduce
	// over on shared memory (gloo.Config.SharedMemoryLanes; 0 automatic).
	GlooLanes int `json:"gloo_lanes"`
	// GlooSegment is the gloo backend's pipelining unit, over TCP and
	// shared memory alike (gloo.Config.SegmentSize and
	// SharedMemorySegment; 0: their defaults).
	GlooSegment int64 `json:"gloo_segment"`
	// Async issues the timed iterations as async ops back to back and then
	// waits for them all (nccl-tests' method; a device backend pipelines
	// them on its stream); off, each op is waited for before the next.
	Async bool `json:"async"`
}

// Duration is a time.Duration that marshals as its string form.
type Duration time.Duration

// MarshalText implements encoding.TextMarshaler.
func (d Duration) MarshalText() ([]byte, error) { return []byte(time.Duration(d).String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	*d = Duration(v)
	return err
}

// DefaultConfig is what `ftbench` with no flags runs: gloo, 2 ranks,
// allreduce of float32 sums from 8 B to 64 MiB doubling, with the raw TCP
// baseline. It finishes in well under two minutes on 2 cores.
func DefaultConfig() Config {
	return Config{
		NP:      2,
		Backend: "gloo",
		MinSize: 8,
		MaxSize: 64 << 20,
		Factor:  2,
		Ops:     []string{"allreduce"},
		DTypes:  []string{"float32"},
		RedOps:  []string{"sum"},
		Warmup:  5,
		Iters:   20,
		Average: 3,
		Raw:     true,
		RawBuf:  0,
		Timeout: Duration(60 * time.Second),
	}
}

// maxNP bounds -np: every rank is a process on this host.
const maxNP = 256

// Validate reports what is wrong with c, or nil.
func (c *Config) Validate() error {
	switch {
	case c.NP < 2 || c.NP > maxNP:
		return usagef("-np %d outside [2, %d] (a collective needs at least two ranks)", c.NP, maxNP)
	case c.Backend == "":
		return usagef("-backend is empty")
	case c.MinSize < 1:
		return usagef("-b %d: the smallest size must be at least 1 byte", c.MinSize)
	case c.MaxSize < c.MinSize:
		return usagef("-e %d is smaller than -b %d", c.MaxSize, c.MinSize)
	case c.Step < 0:
		return usagef("-i %d is negative", c.Step)
	case c.Step == 0 && !(c.Factor > 1):
		return usagef("-f %g must be greater than 1 (or give -i)", c.Factor)
	case c.Warmup < 0:
		return usagef("-w %d is negative", c.Warmup)
	case c.Iters < 1:
		return usagef("-n %d: need at least one timed iteration", c.Iters)
	case c.Average < 0 || c.Average > 3:
		return usagef("-a %d: want 0 (rank 0), 1 (mean), 2 (min) or 3 (max over ranks)", c.Average)
	case c.Root < 0 || c.Root >= c.NP:
		return usagef("-r %d outside [0, %d)", c.Root, c.NP)
	case c.GlooLanes < 0 || c.GlooLanes > 16:
		return usagef("-lanes %d outside [0, 16]", c.GlooLanes)
	case c.GlooSegment != 0 && (c.GlooSegment < 4<<10 || c.GlooSegment > 64<<20):
		return usagef("-segment %d outside [4 KiB, 64 MiB]", c.GlooSegment)
	case c.RawBuf < 0:
		return usagef("-rawbuf %d is negative", c.RawBuf)
	case c.Timeout <= 0:
		return usagef("-timeout %s must be positive", time.Duration(c.Timeout))
	case len(c.Ops) == 0 || len(c.DTypes) == 0 || len(c.RedOps) == 0:
		return usagef("-op, -d and -o each need at least one value")
	}
	if c.NCCLMode != "" {
		if _, err := nccl.ParseMode(c.NCCLMode); err != nil {
			return usagef("-nccl-mode: %v", err)
		}
	}
	for _, o := range c.Ops {
		if _, err := lookupOp(o); err != nil {
			return err
		}
	}
	for _, d := range c.DTypes {
		if _, err := comm.ParseDType(d); err != nil {
			return usagef("-d: %v", err)
		}
	}
	for _, r := range c.RedOps {
		if _, err := comm.ParseReduceOp(r); err != nil {
			return usagef("-o: %v", err)
		}
	}
	if len(c.Sizes()) > 4096 {
		return usagef("the sweep from %d to %d bytes has more than 4096 sizes", c.MinSize, c.MaxSize)
	}
	if len(c.plan()) == 0 {
		return usagef("no (op, dtype, redop) combination of -op %s -d %s -o %s is defined (bitwise ops need an integer dtype)",
			strings.Join(c.Ops, ","), strings.Join(c.DTypes, ","), strings.Join(c.RedOps, ","))
	}
	return nil
}

// Sizes lists the requested byte sizes of the sweep, as nccl-tests steps
// them: from MinSize to MaxSize inclusive, adding Step or multiplying by
// Factor.
func (c *Config) Sizes() []int64 {
	var out []int64
	for s := c.MinSize; s <= c.MaxSize && len(out) <= 4096; {
		out = append(out, s)
		var next int64
		if c.Step > 0 {
			next = s + c.Step
		} else {
			f := math.Floor(float64(s) * c.Factor)
			if f > math.MaxInt64/2 {
				break
			}
			next = int64(f)
		}
		if next <= s {
			next = s + 1
		}
		s = next
	}
	return out
}

// parseSize reads a byte size as nccl-tests does: a number with an optional
// binary suffix K, M or G (also KB/KiB, …; case-insensitive) or a plain B.
func parseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	if t == "" {
		return 0, usagef("empty size")
	}
	mult := int64(1)
	lower := strings.ToLower(t)
	for _, suf := range []struct {
		s string
		m int64
	}{{"kib", 1 << 10}, {"mib", 1 << 20}, {"gib", 1 << 30}, {"kb", 1 << 10}, {"mb", 1 << 20}, {"gb", 1 << 30},
		{"k", 1 << 10}, {"m", 1 << 20}, {"g", 1 << 30}, {"b", 1}} {
		if strings.HasSuffix(lower, suf.s) {
			mult = suf.m
			t = t[:len(t)-len(suf.s)]
			break
		}
	}
	t = strings.TrimSpace(t)
	if n, err := strconv.ParseInt(t, 10, 64); err == nil {
		if n < 0 {
			return 0, usagef("size %q is negative", s)
		}
		if n > math.MaxInt64/mult {
			return 0, usagef("size %q overflows", s)
		}
		return n * mult, nil
	}
	f, err := strconv.ParseFloat(t, 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, usagef("size %q is not a number with an optional K, M or G suffix", s)
	}
	if f < 0 {
		return 0, usagef("size %q is negative", s)
	}
	v := f * float64(mult)
	if v != math.Trunc(v) {
		return 0, usagef("size %q is not a whole number of bytes", s)
	}
	if v >= math.MaxInt64 {
		return 0, usagef("size %q overflows", s)
	}
	return int64(v), nil
}

// sizeFlag is a flag.Value for a byte size.
type sizeFlag struct{ p *int64 }

func (f sizeFlag) String() string {
	if f.p == nil {
		return ""
	}
	return formatSize(*f.p)
}

func (f sizeFlag) Set(s string) error {
	v, err := parseSize(s)
	if err != nil {
		return err
	}
	*f.p = v
	return nil
}

// formatSize writes n with the largest binary suffix that divides it.
func formatSize(n int64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%dG", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dM", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dK", n>>10)
	}
	return strconv.FormatInt(n, 10)
}

// listFlag is a comma-separated flag; "all" expands to every value.
type listFlag struct {
	p     *[]string
	all   []string
	canon func(string) (string, error)
}

func (f listFlag) String() string {
	if f.p == nil {
		return ""
	}
	return strings.Join(*f.p, ",")
}

func (f listFlag) Set(s string) error {
	var out []string
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		if strings.EqualFold(part, "all") {
			out = append(out, f.all...)
			continue
		}
		c, err := f.canon(part)
		if err != nil {
			return err
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return usagef("empty list %q", s)
	}
	*f.p = dedupe(out)
	return nil
}

func dedupe(s []string) []string {
	seen := map[string]bool{}
	out := s[:0:0]
	for _, v := range s {
		if !seen[v] {
			seen[v] = true
			out = append(out, v)
		}
	}
	return out
}

func allDTypes() []string {
	return []string{"float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"}
}

func allRedOps() []string { return []string{"sum", "prod", "min", "max", "avg"} }

// parseFlags fills a Config from args (without the program name).
func parseFlags(args []string) (Config, error) {
	c := DefaultConfig()
	fs := flag.NewFlagSet("ftbench", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: ftbench [flags]\n\nRuns collectives across -np local processes and prints the nccl-tests table.\n\n")
		fs.PrintDefaults()
	}
	fs.IntVar(&c.NP, "np", c.NP, "number of ranks (one process each)")
	fs.StringVar(&c.Backend, "backend", c.Backend, "comm backend: gloo, or nccl (device tensors, GPU = local rank)")
	fs.Var(sizeFlag{&c.MinSize}, "b", "smallest size in bytes (K, M, G suffixes)")
	fs.Var(sizeFlag{&c.MaxSize}, "e", "largest size in bytes (K, M, G suffixes)")
	fs.Float64Var(&c.Factor, "f", c.Factor, "multiply the size by this factor at each step")
	fs.Var(sizeFlag{&c.Step}, "i", "add this many bytes at each step instead of -f")
	fs.Var(listFlag{&c.Ops, opNames(), canonOp}, "op", "collectives, comma separated: "+strings.Join(opNames(), "|")+"|all")
	fs.Var(listFlag{&c.DTypes, allDTypes(), canonDType}, "d", "dtypes, comma separated: "+strings.Join(allDTypes(), "|")+"|all")
	fs.Var(listFlag{&c.RedOps, allRedOps(), canonRedOp}, "o", "reductions, comma separated: "+strings.Join(allRedOps(), "|")+"|all")
	fs.IntVar(&c.Root, "r", c.Root, "root rank of broadcast and reduce")
	fs.IntVar(&c.Warmup, "w", c.Warmup, "warm-up iterations per size")
	fs.IntVar(&c.Iters, "n", c.Iters, "timed iterations per size")
	fs.IntVar(&c.Average, "a", c.Average, "time reported per row: 0 rank 0's, 1 mean, 2 min, 3 max over ranks (nccl-tests' default is 1)")
	fs.BoolVar(&c.Raw, "raw", c.Raw, "also run the raw TCP ring baseline at every size")
	fs.Var(sizeFlag{&c.RawBuf}, "rawbuf", "socket buffer size of the raw baseline (0: kernel autotuning)")
	fs.Var(durationFlag{&c.Timeout}, "timeout", "deadline of each op and of connection setup")
	fs.BoolVar(&c.JSON, "json", c.JSON, "print JSON lines (metadata, then one object per row) instead of the table")
	fs.StringVar(&c.CPUProf, "cpuprofile", c.CPUProf, "write each worker's CPU profile to this path + \".rank<r>\"")
	fs.StringVar(&c.Trace, "trace", c.Trace, "write each worker's execution trace (go tool trace) to this path + \".rank<r>\"")
	fs.BoolVar(&c.Verbose, "v", c.Verbose, "verbose worker logs on stderr")
	fs.BoolVar(&c.Async, "async", c.Async, "issue each size's iterations back to back as async ops, then wait (nccl-tests' method)")
	fs.StringVar(&c.NCCLMode, "nccl-mode", c.NCCLMode, "nccl: comm mode, blocking-data (default: nonblocking control comm, blocking data comm), nonblocking, or blocking (init and shrink cannot be aborted)")
	fs.Var(sizeFlag{&c.GlooSegment}, "segment", "gloo: pipelining unit of the ring algorithms, over TCP and shared memory alike (gloo.Config.SegmentSize and SharedMemorySegment; 0: their defaults, 1 MiB and 4 MiB)")
	fs.IntVar(&c.GlooLanes, "lanes", c.GlooLanes, "gloo: most cores one rank spreads a large all-reduce over on shared memory (0: automatic, see gloo.Config.SharedMemoryLanes; 1: one)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return c, err
		}
		return c, usagef("%v", err)
	}
	if fs.NArg() > 0 {
		return c, usagef("unexpected arguments %q", fs.Args())
	}
	return c, c.Validate()
}

// durationFlag is a flag.Value for a Duration.
type durationFlag struct{ p *Duration }

func (f durationFlag) String() string {
	if f.p == nil {
		return ""
	}
	return time.Duration(*f.p).String()
}

func (f durationFlag) Set(s string) error { return f.p.UnmarshalText([]byte(s)) }
