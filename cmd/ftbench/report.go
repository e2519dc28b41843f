package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"github.com/ftcomm/ftcomm/backends/gloo"
	"github.com/ftcomm/ftcomm/backends/nccl"
)

// Row is one result line: every rank's measurement of one size combined as
// nccl-tests combines them (time of the slowest rank, #wrong summed).
type Row struct {
	Type     string    `json:"type"` // "row"
	Op       string    `json:"op"`   // a collective, or "rawtcp" for the baseline
	Bytes    int64     `json:"bytes"`
	Count    int       `json:"count"`
	DType    string    `json:"dtype"`
	RedOp    string    `json:"redop"`
	Root     int       `json:"root"`
	Usec     float64   `json:"time_us"`
	AlgBW    float64   `json:"algbw_gbps"`
	BusBW    float64   `json:"busbw_gbps"`
	Wrong    int64     `json:"wrong"`
	NP       int       `json:"np"`
	RankUsec []float64 `json:"rank_time_us"`
}

// combine merges the ranks' measurements of one row: #wrong summed, the
// time chosen by average as nccl-tests' -a does (0 rank 0's, 1 the mean,
// 2 the fastest, 3 the slowest rank's). Ranks that disagree on what the row
// is point at a bug; that is an error, not a row.
func combine(rs []rankRow, average int) (Row, error) {
	if len(rs) == 0 {
		return Row{}, fmt.Errorf("ftbench: combine: no ranks")
	}
	f := rs[0]
	row := Row{Type: "row", Op: f.Op, Bytes: f.Bytes, Count: f.Count, DType: f.DType, RedOp: f.RedOp, Root: f.Root,
		NP: len(rs), RankUsec: make([]float64, len(rs))}
	for r, x := range rs {
		if x.Index != f.Index || x.Op != f.Op || x.Bytes != f.Bytes || x.Count != f.Count || x.DType != f.DType ||
			x.RedOp != f.RedOp || x.Root != f.Root {
			return Row{}, fmt.Errorf("ftbench: ranks 0 and %d disagree on row %d: %+v vs %+v", r, f.Index, f, x)
		}
		row.RankUsec[r] = x.Usec
		row.Wrong += x.Wrong
	}
	switch average {
	case 0:
		row.Usec = row.RankUsec[0]
	case 1:
		for _, u := range row.RankUsec {
			row.Usec += u / float64(len(rs))
		}
	case 2:
		row.Usec = slices.Min(row.RankUsec)
	default:
		row.Usec = slices.Max(row.RankUsec)
	}
	factor := rawBusFactor(len(rs))
	if row.Op != rawOp {
		o, err := lookupOp(row.Op)
		if err != nil {
			return Row{}, err
		}
		factor = o.busFactor(len(rs))
	}
	row.AlgBW, row.BusBW = bandwidth(row.Bytes, row.Usec, factor)
	return row, nil
}

// Meta describes the run: the first JSON line, and the table's header.
type Meta struct {
	Type      string    `json:"type"` // "meta"
	Tool      string    `json:"tool"`
	Host      string    `json:"host"`
	Cores     int       `json:"cores"`
	GoVersion string    `json:"go_version"`
	OSArch    string    `json:"os_arch"`
	Commit    string    `json:"commit"`
	Backend   string    `json:"backend"`
	Transport string    `json:"transport,omitempty"` // how the ranks' data moves, where the backend has a choice
	NP        int       `json:"np"`
	Args      []string  `json:"args"`
	Started   time.Time `json:"started"`
	Config    Config    `json:"config"`
}

func newMeta(cfg Config, args []string) Meta {
	host, _ := os.Hostname()
	tr := transport(cfg.Backend)
	if cfg.Backend == "nccl" {
		mode := cfg.NCCLMode
		if mode == "" {
			mode = nccl.DefaultConfig().Mode.String()
		}
		tr = "NCCL comm mode " + mode + " (-nccl-mode)"
	}
	return Meta{Type: "meta", Tool: "ftbench", Host: host, Cores: runtime.NumCPU(), GoVersion: runtime.Version(),
		OSArch: runtime.GOOS + "/" + runtime.GOARCH, Commit: commit(), Backend: cfg.Backend, NP: cfg.NP,
		Args: args, Started: time.Now().UTC().Truncate(time.Second), Config: cfg, Transport: tr}
}

// transport says how the gloo backend's ranks, all on this host, move data.
func transport(backend string) string {
	if backend != "gloo" {
		return ""
	}
	if gloo.SharedMemoryAllowed() {
		return "shared memory between the ranks (TCP for control and liveness; " + gloo.EnvSharedMemory + "=0 for TCP only)"
	}
	return "TCP loopback (" + gloo.EnvSharedMemory + "=0)"
}

// commit is the VCS revision the binary was built from (with "-dirty" for
// local changes), from the build info, else from git in the working
// directory (go run does not stamp it), else "unknown".
func commit() string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		var rev string
		var dirty bool
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
		if rev != "" {
			if dirty {
				rev += "-dirty"
			}
			return rev
		}
	}
	out, err := exec.Command("git", "rev-parse", "HEAD").Output()
	if err != nil {
		return "unknown"
	}
	rev := strings.TrimSpace(string(out))
	if st, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output(); err == nil && len(st) > 0 {
		rev += "-dirty"
	}
	return rev
}

// Summary is the last JSON line.
type Summary struct {
	Type     string  `json:"type"` // "summary"
	Rows     int     `json:"rows"`
	Wrong    int64   `json:"wrong"`
	AvgBusBW float64 `json:"avg_busbw_gbps"` // over the collective rows, as nccl-tests reports it
	OK       bool    `json:"ok"`
	Error    string  `json:"error,omitempty"`
}

// printer writes the result as the nccl-tests table or as JSON lines.
type printer struct {
	w       io.Writer
	json    bool
	lastSer string
	rows    int
	wrong   int64
	busSum  float64
	busN    int
	lastCol *Row    // the latest collective row
	pair    [2]*Row // the latest collective row and the baseline row after it
}

// typeName is the dtype as nccl-tests names it in its type column.
func typeName(dtype string) string {
	switch dtype {
	case "float32":
		return "float"
	case "float64":
		return "double"
	case "float16":
		return "half"
	}
	return dtype
}

// timeStr formats microseconds as nccl-tests does: fewer decimals as the
// number grows, always 7 wide.
func timeStr(us float64) string {
	switch {
	case us >= 10000:
		return fmt.Sprintf("%7.0f", us)
	case us >= 100:
		return fmt.Sprintf("%7.1f", us)
	}
	return fmt.Sprintf("%7.2f", us)
}

const (
	tableHead1 = "#       size         count      type   redop    root     time   algbw   busbw  #wrong"
	tableHead2 = "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)"
)

// formatRow is one table line. Baseline rows are comments (they start with
// '#', which nccl-tests parsers skip) with type "rawtcp".
func formatRow(r Row) string {
	typ := typeName(r.DType)
	if r.Op == rawOp {
		typ = rawOp
	}
	line := fmt.Sprintf("%12d  %12d  %8s  %6s  %6d  %7s  %6.2f  %6.2f  %6d", r.Bytes, r.Count, typ, r.RedOp, r.Root,
		timeStr(r.Usec), r.AlgBW, r.BusBW, r.Wrong)
	if r.Op == rawOp {
		line = "#" + line[1:]
	}
	return line
}

func (p *printer) meta(m Meta) error {
	if p.json {
		return p.writeJSON(m)
	}
	c := m.Config
	sweep := fmt.Sprintf("x%g", c.Factor)
	if c.Step > 0 {
		sweep = "+" + formatSize(c.Step)
	}
	raw := "off"
	if c.Raw {
		raw = "on (lines '#  … rawtcp': plain TCP ring moving an allreduce's bytes; count = bytes sent per rank)"
	}
	_, err := fmt.Fprintf(p.w, "# ftbench: backend %s, %d ranks, host %s, %d cores, %s %s, commit %s\n"+
		"#  ops %s, dtypes %s, redops %s, sizes %s..%s %s, warmup %d, iters %d, op timeout %s\n"+
		"#  time: mean per iteration, %s; GB/s = 1e9 B/s; busbw as nccl-tests\n"+
		"#  raw TCP baseline: %s\n%s#\n%s\n%s\n",
		m.Backend, m.NP, m.Host, m.Cores, m.GoVersion, m.OSArch, m.Commit,
		strings.Join(c.Ops, ","), strings.Join(c.DTypes, ","), strings.Join(c.RedOps, ","),
		formatSize(c.MinSize), formatSize(c.MaxSize), sweep, c.Warmup, c.Iters, time.Duration(c.Timeout),
		[]string{"of rank 0", "averaged over ranks", "of the fastest rank", "of the slowest rank"}[c.Average], raw,
		transportLine(m.Transport), tableHead1, tableHead2)
	return err
}

func transportLine(t string) string {
	if t == "" {
		return ""
	}
	return "#  transport: " + t + "\n"
}

func (p *printer) row(r Row) error {
	p.rows++
	p.wrong += r.Wrong
	if r.Op == rawOp {
		p.pair = [2]*Row{p.lastCol, &r}
	} else {
		p.busSum += r.BusBW
		p.busN++
		p.lastCol = &r
	}
	if p.json {
		return p.writeJSON(r)
	}
	if r.Op != rawOp {
		if ser := r.Op + " " + r.DType + " " + r.RedOp; ser != p.lastSer {
			if p.lastSer != "" {
				if _, err := fmt.Fprintln(p.w, "#"); err != nil {
					return err
				}
			}
			if _, err := fmt.Fprintf(p.w, "# %s\n", r.Op); err != nil {
				return err
			}
			p.lastSer = ser
		}
	}
	_, err := fmt.Fprintln(p.w, formatRow(r))
	return err
}

func (p *printer) summary(failure error) (Summary, error) {
	s := Summary{Type: "summary", Rows: p.rows, Wrong: p.wrong, OK: failure == nil && p.wrong == 0}
	if p.busN > 0 {
		s.AvgBusBW = p.busSum / float64(p.busN)
	}
	if failure != nil {
		s.Error = failure.Error()
	}
	if p.json {
		return s, p.writeJSON(s)
	}
	verdict := "OK"
	if !s.OK {
		verdict = "FAILED"
	}
	_, err := fmt.Fprintf(p.w, "# Out of bounds values : %d %s\n# Avg bus bandwidth    : %g\n", p.wrong, verdict, roundTo3(s.AvgBusBW))
	if col, raw := p.pair[0], p.pair[1]; err == nil && col != nil && raw != nil && raw.BusBW > 0 {
		_, err = fmt.Fprintf(p.w, "# %s at %s: busbw %.2f GB/s = %.0f%% of the raw TCP ring's %.2f GB/s\n",
			col.Op, formatSize(col.Bytes), col.BusBW, 100*col.BusBW/raw.BusBW, raw.BusBW)
	}
	if err == nil && failure != nil {
		_, err = fmt.Fprintf(p.w, "# FAILED: %v\n", failure)
	}
	return s, err
}

func roundTo3(x float64) float64 { return math.Round(x*1000) / 1000 }

func (p *printer) writeJSON(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = p.w.Write(append(b, '\n'))
	return err
}
