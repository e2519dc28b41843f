package main

import (
	"errors"
	"flag"
	"reflect"
	"testing"
	"time"
)

func TestParseSize(t *testing.T) {
	good := []struct {
		in   string
		want int64
	}{
		{"8", 8}, {"0", 0}, {"4K", 4 << 10}, {"4k", 4 << 10}, {"4KB", 4 << 10}, {"4KiB", 4 << 10},
		{"64M", 64 << 20}, {"64MiB", 64 << 20}, {"1G", 1 << 30}, {"2g", 2 << 30}, {"512B", 512},
		{"1.5K", 1536}, {"0.5M", 512 << 10}, {" 16M ", 16 << 20},
	}
	for _, c := range good {
		got, err := parseSize(c.in)
		if err != nil || got != c.want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", c.in, got, err, c.want)
		}
	}
	for _, in := range []string{"", "K", "abc", "-1", "-4K", "1.5", "0.3K", "10X", "4 K B", "NaN", "Inf", "9999999999G", "1e30"} {
		if got, err := parseSize(in); err == nil || !errors.Is(err, errUsage) {
			t.Errorf("parseSize(%q) = %d, %v; want a usage error", in, got, err)
		}
	}
}

func TestSizes(t *testing.T) {
	c := DefaultConfig()
	s := c.Sizes()
	if len(s) != 24 || s[0] != 8 || s[len(s)-1] != 64<<20 {
		t.Fatalf("default sweep: %d sizes from %d to %d; want 24 from 8 to 64M", len(s), s[0], s[len(s)-1])
	}
	for i := 1; i < len(s); i++ {
		if s[i] != 2*s[i-1] {
			t.Fatalf("default sweep not doubling at %d: %v", i, s)
		}
	}
	c.MinSize, c.MaxSize, c.Factor = 1<<20, 64<<20, 4
	if got, want := c.Sizes(), []int64{1 << 20, 4 << 20, 16 << 20, 64 << 20}; !reflect.DeepEqual(got, want) {
		t.Errorf("-b 1M -e 64M -f 4: %v, want %v", got, want)
	}
	c.MinSize, c.MaxSize, c.Step = 100, 400, 100
	if got, want := c.Sizes(), []int64{100, 200, 300, 400}; !reflect.DeepEqual(got, want) {
		t.Errorf("-i 100: %v, want %v", got, want)
	}
	c.MinSize, c.MaxSize, c.Step, c.Factor = 1, 4, 0, 1.1 // 1*1.1 floors to 1: must still advance
	if got, want := c.Sizes(), []int64{1, 2, 3, 4}; !reflect.DeepEqual(got, want) {
		t.Errorf("-f 1.1 from 1: %v, want %v", got, want)
	}
}

func TestParseFlags(t *testing.T) {
	c, err := parseFlags(nil)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(c, DefaultConfig()) {
		t.Errorf("no flags: %+v, want the defaults %+v", c, DefaultConfig())
	}
	c, err = parseFlags([]string{"-np", "4", "-b", "1K", "-e", "1M", "-f", "4", "-op", "all", "-d", "fp16,bf16,f32,fp16",
		"-o", "sum,max", "-w", "1", "-n", "3", "-raw=false", "-timeout", "5s", "-json", "-r", "3"})
	if err != nil {
		t.Fatal(err)
	}
	if c.NP != 4 || c.MinSize != 1<<10 || c.MaxSize != 1<<20 || c.Factor != 4 || c.Warmup != 1 || c.Iters != 3 ||
		c.Raw || !c.JSON || c.Root != 3 || time.Duration(c.Timeout) != 5*time.Second {
		t.Errorf("parsed %+v", c)
	}
	if !reflect.DeepEqual(c.Ops, opNames()) {
		t.Errorf("-op all = %v, want %v", c.Ops, opNames())
	}
	if want := []string{"float16", "bfloat16", "float32"}; !reflect.DeepEqual(c.DTypes, want) {
		t.Errorf("-d fp16,bf16,f32,fp16 = %v, want %v", c.DTypes, want)
	}
	if _, err := parseFlags([]string{"-h"}); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("-h: %v, want flag.ErrHelp", err)
	}
	bad := [][]string{
		{"-np", "1"}, {"-np", "1000"}, {"-b", "64M", "-e", "8"}, {"-b", "0"}, {"-f", "1"}, {"-n", "0"}, {"-w", "-1"},
		{"-op", "allreduce,bogus"}, {"-d", "float128"}, {"-o", "xor"}, {"-r", "2"}, {"-timeout", "0s"},
		{"-d", "float32", "-o", "band"}, {"-a", "4"}, {"-e", "nonsense"}, {"extra"}, {"-b", "1", "-e", "1G", "-i", "1"},
	}
	for _, args := range bad {
		if _, err := parseFlags(args); !errors.Is(err, errUsage) {
			t.Errorf("parseFlags(%q) = %v; want a usage error", args, err)
		}
	}
}

func TestPlanSkipsUndefinedCombinations(t *testing.T) {
	c := DefaultConfig()
	c.Ops = []string{"allreduce", "allgather"}
	c.DTypes = []string{"int32", "float32"}
	c.RedOps = []string{"sum", "avg", "bor"}
	var got []string
	for _, s := range c.plan() {
		got = append(got, s.Op.name+"/"+s.DType.String()+"/"+s.Red.String())
	}
	want := []string{"allreduce/int32/sum", "allreduce/int32/avg", "allreduce/int32/bor", "allreduce/float32/sum",
		"allreduce/float32/avg", "allgather/int32/reduceop(0)", "allgather/float32/reduceop(0)"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("plan = %v\nwant %v", got, want)
	}
	if i := rawSeries(c.plan()); i != 0 {
		t.Errorf("raw baseline follows series %d, want 0 (allreduce)", i)
	}
}
