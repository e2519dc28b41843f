package main

import (
	"bytes"
	"encoding/json"
	"math"
	"strings"
	"testing"

	"github.com/ftcomm/ftcomm/backends/gloo"
	"github.com/ftcomm/ftcomm/comm"
)

// nccl-tests' definitions (doc/PERFORMANCE.md): busbw = algbw × factor.
func TestBusFactorsMatchNCCLTests(t *testing.T) {
	for _, n := range []int{2, 3, 4, 8, 16} {
		nf := float64(n)
		want := map[string]float64{
			"allreduce":     2 * (nf - 1) / nf,
			"allgather":     (nf - 1) / nf,
			"reducescatter": (nf - 1) / nf,
			"alltoall":      (nf - 1) / nf,
			"broadcast":     1,
			"reduce":        1,
			"sendrecv":      1,
		}
		if len(want) != len(ops) {
			t.Fatalf("test covers %d ops, ftbench has %d", len(want), len(ops))
		}
		for _, o := range ops {
			if got := o.busFactor(n); math.Abs(got-want[o.name]) > 1e-15 {
				t.Errorf("%s busFactor(%d) = %v, want %v", o.name, n, got, want[o.name])
			}
		}
		if got := rawBusFactor(n); got != want["allreduce"] {
			t.Errorf("raw baseline factor(%d) = %v, want allreduce's %v", n, got, want["allreduce"])
		}
	}
	// 64 MiB in 50 ms on 4 ranks: algbw 1.342 GB/s (GB = 1e9), busbw ×1.5.
	alg, bus := bandwidth(64<<20, 50000, 1.5)
	if math.Abs(alg-1.34217728) > 1e-9 || math.Abs(bus-1.5*1.34217728) > 1e-9 {
		t.Errorf("bandwidth = %v, %v", alg, bus)
	}
	if alg, bus := bandwidth(8, 0, 1); alg != 0 || bus != 0 {
		t.Errorf("zero time: %v %v, want 0 0", alg, bus)
	}
}

func TestGeometry(t *testing.T) {
	ar, _ := lookupOp("allreduce")
	ag, _ := lookupOp("allgather")
	cases := []struct {
		o      opSpec
		req    int64
		dt     comm.DType
		n      int
		count  int
		nbytes int64
	}{
		{ar, 8, comm.Float32, 4, 2, 8},
		{ar, 7, comm.Float32, 4, 1, 4},
		{ar, 3, comm.Float64, 2, 0, 0},
		{ag, 1000, comm.Float32, 4, 62, 992}, // per-rank blocks: 4 × 62 floats
		{ag, 8, comm.Float32, 4, 0, 0},
		{ag, 64 << 20, comm.BFloat16, 2, 16 << 20, 64 << 20},
	}
	for _, c := range cases {
		g := geometryOf(c.o, c.req, c.dt, c.n)
		if g.Count != c.count || g.Bytes != c.nbytes {
			t.Errorf("%s %d B %s n=%d: %+v, want count %d bytes %d", c.o.name, c.req, c.dt, c.n, g, c.count, c.nbytes)
		}
	}
}

func TestFormatRow(t *testing.T) {
	r := Row{Op: "allreduce", Bytes: 67108864, Count: 16777216, DType: "float32", RedOp: "sum", Root: -1,
		Usec: 61234.4, AlgBW: 1.0959, BusBW: 1.0959, Wrong: 0}
	want := "    67108864      16777216     float     sum      -1    61234    1.10    1.10       0"
	if got := formatRow(r); got != want {
		t.Errorf("formatRow:\n got %q\nwant %q", got, want)
	}
	raw := Row{Op: rawOp, Bytes: 4096, Count: 4096, DType: "uint8", RedOp: "none", Root: -1, Usec: 12.345, AlgBW: 0.33, BusBW: 0.33}
	want = "#       4096          4096    rawtcp    none      -1    12.35    0.33    0.33       0"
	if got := formatRow(raw); got != want {
		t.Errorf("formatRow(raw):\n got %q\nwant %q", got, want)
	}
	// Columns line up under the header, whatever the row.
	for _, h := range []string{tableHead1, tableHead2} {
		if len(h) > len(want) {
			t.Errorf("header longer than a row: %q", h)
		}
	}
	if !strings.HasSuffix(tableHead1, "#wrong") || len(tableHead1) != len(want) {
		t.Errorf("header %q does not end over the #wrong column (row length %d, header %d)", tableHead1, len(want), len(tableHead1))
	}
	for _, c := range []struct {
		us   float64
		want string
	}{{1.234, "   1.23"}, {99.999, " 100.00"}, {123.45, "  123.5"}, {9999.9, " 9999.9"}, {12345.6, "  12346"}} {
		if got := timeStr(c.us); got != c.want {
			t.Errorf("timeStr(%v) = %q, want %q", c.us, got, c.want)
		}
	}
}

func TestCombine(t *testing.T) {
	rs := []rankRow{
		{Index: 3, Op: "allgather", DType: "float32", RedOp: "none", Root: -1, Bytes: 4000, Count: 500, Usec: 10, Wrong: 1},
		{Index: 3, Op: "allgather", DType: "float32", RedOp: "none", Root: -1, Bytes: 4000, Count: 500, Usec: 40, Wrong: 0},
		{Index: 3, Op: "allgather", DType: "float32", RedOp: "none", Root: -1, Bytes: 4000, Count: 500, Usec: 20, Wrong: 2},
		{Index: 3, Op: "allgather", DType: "float32", RedOp: "none", Root: -1, Bytes: 4000, Count: 500, Usec: 30, Wrong: 0},
	}
	row, err := combine(rs, 3)
	if err != nil {
		t.Fatal(err)
	}
	for avg, want := range []float64{10, 25, 10, 40} {
		r, err := combine(rs, avg)
		if err != nil || r.Usec != want {
			t.Errorf("-a %d: time %v, %v; want %v", avg, r.Usec, err, want)
		}
	}
	// slowest rank: 40 µs; 4000 B / 40 µs = 0.1 GB/s; busbw × 3/4.
	if row.Usec != 40 || row.Wrong != 3 || math.Abs(row.AlgBW-0.1) > 1e-12 || math.Abs(row.BusBW-0.075) > 1e-12 || row.NP != 4 {
		t.Errorf("combine = %+v", row)
	}
	rs[2].Bytes = 8000
	if _, err := combine(rs, 3); err == nil {
		t.Error("ranks disagreeing on the size: no error")
	}
}

func TestPrinterJSONAndSummary(t *testing.T) {
	var buf bytes.Buffer
	p := &printer{w: &buf, json: true}
	cfg := DefaultConfig()
	if err := p.meta(newMeta(cfg, []string{"ftbench"})); err != nil {
		t.Fatal(err)
	}
	p.row(Row{Type: "row", Op: "allreduce", Bytes: 8, Count: 2, DType: "float32", RedOp: "sum", Root: -1, Usec: 10, BusBW: 0.5, Wrong: 0})
	p.row(Row{Type: "row", Op: rawOp, Bytes: 8, Count: 8, DType: "uint8", RedOp: "none", Root: -1, Usec: 5, BusBW: 1, Wrong: 0})
	p.row(Row{Type: "row", Op: "allreduce", Bytes: 16, Count: 4, DType: "float32", RedOp: "sum", Root: -1, Usec: 10, BusBW: 1.5, Wrong: 2})
	s, err := p.summary(nil)
	if err != nil {
		t.Fatal(err)
	}
	if s.OK || s.Wrong != 2 || s.Rows != 3 || s.AvgBusBW != 1 {
		t.Errorf("summary %+v: want not OK, 2 wrong, 3 rows, avg busbw 1 (baseline rows excluded)", s)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 5 {
		t.Fatalf("%d JSON lines, want 5:\n%s", len(lines), buf.String())
	}
	var m Meta
	if err := json.Unmarshal([]byte(lines[0]), &m); err != nil || m.Type != "meta" || m.NP != 2 || m.Backend != "gloo" || m.Cores < 1 || m.GoVersion == "" || m.Commit == "" {
		t.Errorf("meta %+v, %v", m, err)
	}
	var r Row
	if err := json.Unmarshal([]byte(lines[2]), &r); err != nil || r.Op != rawOp {
		t.Errorf("row 2: %+v %v", r, err)
	}
}

func TestPrinterTable(t *testing.T) {
	var buf bytes.Buffer
	p := &printer{w: &buf}
	p.meta(newMeta(DefaultConfig(), nil))
	p.row(Row{Op: "allreduce", Bytes: 1 << 20, Count: 1 << 18, DType: "float32", RedOp: "sum", Root: -1, Usec: 1000, AlgBW: 1.048576, BusBW: 1.048576})
	p.row(Row{Op: rawOp, Bytes: 1 << 20, Count: 1 << 20, DType: "uint8", RedOp: "none", Root: -1, Usec: 500, AlgBW: 2.097152, BusBW: 2.097152})
	p.summary(nil)
	out := buf.String()
	for _, want := range []string{
		tableHead1, "\n# allreduce\n", "     1048576        262144     float     sum      -1   1000.0    1.05    1.05       0\n",
		"\n#    1048576       1048576    rawtcp", "# Out of bounds values : 0 OK\n",
		"# allreduce at 1M: busbw 1.05 GB/s = 50% of the raw TCP ring's 2.10 GB/s\n",
		"#  transport: shared memory between the ranks",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}

func TestTransportFollowsTheEnvironment(t *testing.T) {
	t.Setenv(gloo.EnvSharedMemory, "0")
	if got := transport("gloo"); got != "TCP loopback (FTCOMM_GLOO_SHM=0)" {
		t.Errorf("gloo with shared memory off: %q", got)
	}
	if got := transport("nccl"); got != "" {
		t.Errorf("nccl: %q, want none", got)
	}
}
