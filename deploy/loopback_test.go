package deploy

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"sigs.k8s.io/yaml"

	"github.com/ftcomm/ftcomm/coordinator/server"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

// TestLoopbackDeployment is the 3-replica topology of
// kubernetes/overlays/ha as processes on loopback, started the way the
// manifests start it: etcd with the StatefulSet's arguments, ftcoord
// etcd-init and ftcoord serve with the environment of their manifests,
// trainers with the training Job's — only names, ports and file paths are
// mapped to this machine (a manifest setting the test cannot map fails
// it). A 3-member etcd cluster with TLS, client certificates and
// authentication; three coordinators; two trainers join with the
// credentials file that `ftcoord credentials` prints; the leader is
// SIGKILLed and another coordinator publishes the next epoch when a third
// trainer joins; then a coordinator and a trainer stop gracefully.
func TestLoopbackDeployment(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	tp := startTopology(t, ctx)
	dir, bin, paths, creds, api, apis, coords := tp.dir, tp.bin, tp.paths, tp.creds, tp.api, tp.apis, tp.coords
	checkEtcdSecured(t, ctx, creds, tp.endpoints, tp.pki)

	// Trainers, as the Job's pods: JOB_COMPLETION_INDEX names the group.
	os.WriteFile(filepath.Join(dir, "job-secret"), []byte(randomHex(32)), 0o600)
	jobC := manifestContainer(t, "kubernetes/base/training-job/job.yaml")
	trainerEnv := func(index int) []string {
		r := strings.NewReplacer(append(paths,
			"/etc/ftcomm/credentials/trainer-credentials.json", creds,
			"/etc/ftcomm/job-secret/secret", filepath.Join(dir, "job-secret"))...)
		return manifestEnv(t, jobC, r, map[string]string{
			"JOB_COMPLETION_INDEX": strconv.Itoa(index),
			// One host: ports the OS picks (peers learn them through etcd).
			"FTCOMM_RECOVERY_PORT": "0", "FTCOMM_GOSSIP_PORT": "0", "FTCOMM_PROBE_ADDR": "127.0.0.1:0",
			"FTCOMM_STEPS": "1000000", "FTCOMM_STEP_TIME": "20ms",
		})
	}
	job := valueOf(t, jobC, "FTCOMM_JOB")
	began := time.Now()
	trainers := []*proc{startProc(t, "g0", trainerEnv(0), bin("trainer")), startProc(t, "g1", trainerEnv(1), bin("trainer"))}
	q := waitQuorum(t, ctx, api, apis, job, 0, 2, "")
	leader := q.PublishedBy
	t.Logf("epoch %d with %d participants, published by %s %v after the trainers started", q.Epoch, len(q.Participants), leader, time.Since(began).Round(time.Millisecond))

	// The leader dies; the next epoch (a third trainer joins) comes from
	// another coordinator.
	killed := time.Now()
	coords[leader].cmd.Process.Signal(syscall.SIGKILL)
	delete(apis, leader)
	trainers = append(trainers, startProc(t, "g2", trainerEnv(2), bin("trainer")))
	q2 := waitQuorum(t, ctx, api, apis, job, q.Epoch, 3, leader)
	t.Logf("leader %s SIGKILLed: %s published epoch %d with 3 participants %v later", leader, q2.PublishedBy, q2.Epoch, time.Since(killed).Round(time.Millisecond))
	trainers[2].waitLog(t, `"participants":3`, time.Minute) // it healed and commits with the others
	t.Logf("g2 commits with 3 participants %v after the kill", time.Since(killed).Round(time.Millisecond))

	// Graceful: the new leader stops within its shutdown timeout and a
	// standby takes over at once; a trainer leaves and the job goes on
	// without it.
	second := coords[q2.PublishedBy]
	stopped := time.Now()
	second.cmd.Process.Signal(syscall.SIGTERM)
	if code := second.wait(t, 15*time.Second); code != 0 {
		t.Fatalf("SIGTERMed %s exited %d", second.name, code)
	}
	t.Logf("SIGTERMed leader %s exited in %v", second.name, time.Since(stopped).Round(time.Millisecond))
	delete(apis, second.name)
	trainers[0].cmd.Process.Signal(syscall.SIGTERM)
	if code := trainers[0].wait(t, 15*time.Second); code != 0 || !strings.Contains(trainers[0].output(), "left the job") {
		t.Fatalf("SIGTERMed trainer exited %d", code)
	}
	q3 := waitQuorum(t, ctx, api, apis, job, q2.Epoch, 2, second.name)
	t.Logf("trainer g0 left: %s published epoch %d with %d participants", q3.PublishedBy, q3.Epoch, len(q3.Participants))
}

// topology is the coordinators' side of kubernetes/overlays/ha running on
// loopback: see startTopology.
type topology struct {
	dir       string
	bin       func(string) string
	pki       string
	endpoints []string          // etcd's client addresses
	etcd      []*proc           // etcd-0, etcd-1, etcd-2
	coords    map[string]*proc  // by name: ftcoord-0, …
	apis      map[string]string // the coordinators' API URLs, by name
	envs      map[string][]string
	paths     []string // the manifests' paths and names → this machine's
	creds     string   // the trainers' credentials file
	api       *apiClient
}

// startTopology starts, as the manifests do, etcd's three members,
// etcd-init and the ftcoord StatefulSet's three instances, waits until
// each is ready (the readiness probes) and one leads, and writes the
// trainers' credentials file as `ftcoord credentials` prints it.
func startTopology(t *testing.T, ctx context.Context) *topology {
	t.Helper()
	dir := t.TempDir()
	began := time.Now()
	bin := buildBinaries(t)
	t.Logf("go build: %v", time.Since(began).Round(time.Millisecond))
	began = time.Now()
	pki := filepath.Join(dir, "pki")
	run(t, nil, bin("ftcoord"), "certs", "-dir", pki)

	// etcd: three members, as the StatefulSet runs them.
	etcdArgs := manifestContainer(t, "kubernetes/base/etcd/statefulset.yaml").Args
	type member struct{ client, peer, metrics string }
	var members [3]member
	for i := range members {
		members[i] = member{freeAddr(t), freeAddr(t), freeAddr(t)}
	}
	var endpoints []string
	var etcdProcs []*proc
	for i := range members {
		endpoints = append(endpoints, members[i].client)
	}
	for i, m := range members {
		pairs := []string{
			"$(POD_NAME).etcd.$(POD_NAMESPACE).svc:2379", m.client,
			"$(POD_NAME).etcd.$(POD_NAMESPACE).svc:2380", m.peer,
			"0.0.0.0:2379", m.client, "0.0.0.0:2380", m.peer, "0.0.0.0:2381", m.metrics,
			"/var/lib/etcd/data", filepath.Join(dir, fmt.Sprintf("etcd-%d", i)),
			"/etc/etcd/pki/ca.crt", filepath.Join(pki, "ca.pem"),
			"/etc/etcd/pki/tls.crt", filepath.Join(pki, "server.pem"),
			"/etc/etcd/pki/tls.key", filepath.Join(pki, "server-key.pem"),
		}
		for j := range members {
			pairs = append(pairs, fmt.Sprintf("etcd-%d.etcd.$(POD_NAMESPACE).svc:2380", j), members[j].peer)
		}
		pairs = append(pairs, "$(POD_NAME)", fmt.Sprintf("etcd-%d", i))
		r := strings.NewReplacer(pairs...)
		var args []string
		for _, a := range etcdArgs {
			args = append(args, mapped(t, r, a))
		}
		etcdProcs = append(etcdProcs, startProc(t, fmt.Sprintf("etcd-%d", i), nil, bin("etcd"), args...))
	}
	for _, m := range members { // the readiness probe: GET /readyz on the metrics port
		waitHTTP(t, ctx, "http://"+m.metrics+"/readyz")
	}
	t.Logf("etcd ready: %v", time.Since(began).Round(time.Millisecond))

	// The files an operator makes once: coordinator secrets, the API
	// token (Secrets in the cluster).
	secrets := filepath.Join(dir, "secrets", "coordinator-secrets.json")
	os.MkdirAll(filepath.Dir(secrets), 0o700)
	run(t, nil, bin("ftcoord"), "secrets", "-secrets-file", secrets)
	token := randomHex(16)
	os.WriteFile(filepath.Join(dir, "token"), []byte(token+"\n"), 0o600)

	paths := []string{
		"/etc/ftcomm/etcd-root/ca.crt", filepath.Join(pki, "ca.pem"),
		"/etc/ftcomm/etcd-root/tls.crt", filepath.Join(pki, "root.pem"),
		"/etc/ftcomm/etcd-root/tls.key", filepath.Join(pki, "root-key.pem"),
		"/etc/ftcomm/etcd-client/ca.crt", filepath.Join(pki, "ca.pem"),
		"/etc/ftcomm/etcd-client/tls.crt", filepath.Join(pki, "ftcoord.pem"),
		"/etc/ftcomm/etcd-client/tls.key", filepath.Join(pki, "ftcoord-key.pem"),
		"/etc/ftcomm/etcd-trainer/tls.crt", filepath.Join(pki, "trainer.pem"),
		"/etc/ftcomm/etcd-trainer/tls.key", filepath.Join(pki, "trainer-key.pem"),
		"/etc/ftcomm/secrets/coordinator-secrets.json", secrets,
		"/etc/ftcomm/token/token", filepath.Join(dir, "token"),
		"$(POD_IP)", "127.0.0.1",
	}
	for j := range members {
		paths = append(paths, fmt.Sprintf("etcd-%d.etcd.$(POD_NAMESPACE).svc:2379", j), members[j].client)
	}

	// etcd-init, as its Job runs it: users, roles, authentication on.
	initC := manifestContainer(t, "kubernetes/base/etcd/etcd-init-job.yaml")
	run(t, manifestEnv(t, initC, strings.NewReplacer(paths...), nil), bin("ftcoord"), initC.Args...)

	// Three coordinators, as the ftcoord StatefulSet runs them.
	coordC := manifestContainer(t, "kubernetes/base/ftcoord/statefulset.yaml")
	coords := map[string]*proc{}
	apis := map[string]string{}
	envs := map[string][]string{}
	for i := 0; i < 3; i++ {
		name := fmt.Sprintf("ftcoord-%d", i)
		api := freeAddr(t)
		r := strings.NewReplacer(append(paths,
			"/var/lib/ftcoord", filepath.Join(dir, name),
			"0.0.0.0:8080", api,
			"0.0.0.0:7946", freeAddr(t))...)
		// The pod's host name is its name: -name's default.
		env := manifestEnv(t, coordC, r, map[string]string{"FTCOORD_NAME": name})
		envs[name] = env
		coords[name] = startProc(t, name, env, bin("ftcoord"), coordC.Args...)
		apis[name] = "http://" + api
	}
	for name, p := range coords {
		p.waitLog(t, `"msg":"serving"`, time.Minute)
		if !strings.Contains(p.output(), `"msg":"trainer credentials written`) {
			t.Fatalf("%s wrote no credentials", name)
		}
		// The readiness probe: ready while etcd answers the coordinator's
		// user (authentication on).
		waitHTTP(t, ctx, apis[name]+coordC.ReadinessProbe.HTTPGet.Path)
	}
	api := &apiClient{token: token}
	var info server.CoordinatorInfo
	testutil.WaitFor(t, ctx, "a leader", func() bool {
		return api.get(apis["ftcoord-0"]+"/api/v1/coordinator", &info) == nil && info.Leader != ""
	})
	if info.URL != apis["ftcoord-0"] {
		t.Errorf("ftcoord-0 advertises %q, listens at %s", info.URL, apis["ftcoord-0"])
	}

	// The trainers' credentials, as `kubectl exec ftcoord-0 -- /ftcoord
	// credentials` prints them into the Secret the Job mounts.
	creds := filepath.Join(dir, "trainer-credentials.json")
	out := run(t, envs["ftcoord-0"], bin("ftcoord"), "credentials")
	os.WriteFile(creds, []byte(out), 0o600)
	t.Logf("etcd-init, 3 ftcoord ready, credentials: %v after etcd", time.Since(began).Round(time.Millisecond))
	return &topology{dir: dir, bin: bin, pki: pki, endpoints: endpoints, etcd: etcdProcs, coords: coords, apis: apis,
		envs: envs, paths: paths, creds: creds, api: api}
}

// checkEtcdSecured shows that the external etcd wants a client
// certificate and that a trainer may not write a quorum.
func checkEtcdSecured(t *testing.T, ctx context.Context, credsFile string, endpoints []string, pki string) {
	t.Helper()
	creds, err := membership.LoadCredentials(credsFile)
	if err != nil {
		t.Fatal(err)
	}
	if creds.CACert == "" || creds.Cert == "" || len(creds.QuorumKeys) != 1 || len(creds.GossipKey) == 0 || len(creds.Endpoints) != 3 {
		t.Fatalf("credentials lack something: %+v", creds.Endpoints)
	}
	cli, err := creds.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err = cli.Put(wctx, etcdkeys.Layout{Root: creds.Root}.Quorum("demo-job"), "{}")
	if err == nil || !strings.Contains(err.Error(), "permission denied") {
		t.Fatalf("a trainer wrote a quorum: %v", err)
	}
	tc, err := (transport.TLSInfo{TrustedCAFile: filepath.Join(pki, "ca.pem")}).ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	anon, err := clientv3.New(clientv3.Config{Endpoints: endpoints, TLS: tc, DialTimeout: 2 * time.Second, Logger: zap.NewNop()})
	if err == nil {
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err = anon.Get(actx, "/ftcomm/")
		cancel()
		anon.Close()
	}
	if err == nil {
		t.Fatal("etcd answered a client without a certificate")
	}
}

// container is what the test reads of a manifest's first container.
type container struct {
	Args           []string `json:"args"`
	ReadinessProbe struct {
		HTTPGet struct {
			Path string `json:"path"`
		} `json:"httpGet"`
	} `json:"readinessProbe"`
	Env []struct {
		Name      string `json:"name"`
		Value     string `json:"value"`
		ValueFrom any    `json:"valueFrom"`
	} `json:"env"`
}

// manifestContainer reads the first container of a StatefulSet's or a
// Job's pod template.
func manifestContainer(t *testing.T, path string) container {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var obj struct {
		Spec struct {
			Template struct {
				Spec struct {
					Containers []container `json:"containers"`
				} `json:"spec"`
			} `json:"template"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(b, &obj); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	if len(obj.Spec.Template.Spec.Containers) == 0 {
		t.Fatalf("%s: no container", path)
	}
	return obj.Spec.Template.Spec.Containers[0]
}

func valueOf(t *testing.T, c container, name string) string {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value
		}
	}
	t.Fatalf("the manifest sets no %s", name)
	return ""
}

// manifestEnv is a process environment: this one without FTCOORD_ and
// FTCOMM_ variables, then the container's variables with literal values
// mapped by r (those from the downward API are what r maps their
// references to), then set (which wins, and may add variables).
func manifestEnv(t *testing.T, c container, r *strings.Replacer, set map[string]string) []string {
	t.Helper()
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "FTCOORD_") && !strings.HasPrefix(kv, "FTCOMM_") {
			env = append(env, kv)
		}
	}
	seen := map[string]bool{}
	for _, e := range c.Env {
		seen[e.Name] = true
		if e.ValueFrom != nil {
			continue
		}
		if v, ok := set[e.Name]; ok {
			env = append(env, e.Name+"="+v)
			continue
		}
		env = append(env, e.Name+"="+mapped(t, r, e.Value))
	}
	for k, v := range set {
		if !seen[k] {
			env = append(env, k+"="+v)
		}
	}
	return env
}

// mapped maps a manifest's value to this machine and fails on a name,
// address or path it does not know how to map.
func mapped(t *testing.T, r *strings.Replacer, v string) string {
	t.Helper()
	m := r.Replace(v)
	for _, cluster := range []string{"$(", ".svc", "0.0.0.0", "/etc/", "/var/lib/"} {
		if strings.Contains(m, cluster) {
			t.Fatalf("the test cannot map %q to loopback (got %q): update it with the manifest", v, m)
		}
	}
	return m
}

// binaries are the commands the loopback tests run, built once per test
// process (linking them takes long on a loaded machine) into a directory
// TestMain removes.
var binaries struct {
	once sync.Once
	dir  string
	err  error
}

// buildBinaries builds ftcoord, etcd and the example trainer (once) and
// returns a function from a binary's name to its path.
func buildBinaries(t *testing.T) func(string) string {
	t.Helper()
	binaries.once.Do(func() {
		dir, err := os.MkdirTemp("", "ftcomm-deploy-bin-")
		if err != nil {
			binaries.err = err
			return
		}
		binaries.dir = dir
		cmd := exec.Command("go", "build", "-o", dir+"/", "./cmd/ftcoord", "./deploy/etcd", "./examples/trainer")
		cmd.Dir = ".."
		if out, err := cmd.CombinedOutput(); err != nil {
			binaries.err = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binaries.err != nil {
		t.Fatal(binaries.err)
	}
	return func(name string) string { return filepath.Join(binaries.dir, name) }
}

func TestMain(m *testing.M) {
	code := m.Run()
	if binaries.dir != "" {
		os.RemoveAll(binaries.dir)
	}
	os.Exit(code)
}

// run runs a command to completion and returns its standard output.
func run(t *testing.T, env []string, bin string, args ...string) string {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = env
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s%s", filepath.Base(bin), strings.Join(args, " "), err, out, stderr.Bytes())
	}
	return string(out)
}

// freeAddr is a loopback host:port free for TCP and UDP now (the process
// it is handed to binds it a moment later).
func freeAddr(t *testing.T) string {
	t.Helper()
	for {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := l.Addr().String()
		u, err := net.ListenPacket("udp", addr)
		l.Close()
		if err == nil {
			u.Close()
			return addr
		}
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

func waitHTTP(t *testing.T, ctx context.Context, url string) {
	t.Helper()
	testutil.WaitFor(t, ctx, url, func() bool {
		resp, err := http.Get(url)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

type apiClient struct{ token string }

func (a *apiClient) get(url string, out any) error {
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	req.Header.Set("Authorization", "Bearer "+a.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", resp.Status, b)
	}
	return json.Unmarshal(b, out)
}

// waitQuorum waits until a coordinator's API shows a quorum of job after
// epoch with participants participants, published by anyone but notBy.
func waitQuorum(t *testing.T, ctx context.Context, api *apiClient, apis map[string]string, job string, epoch uint64, participants int, notBy string) membership.Quorum {
	t.Helper()
	var q membership.Quorum
	testutil.WaitFor(t, ctx, fmt.Sprintf("epoch after %d with %d participants", epoch, participants), func() bool {
		for _, url := range apis {
			if api.get(url+"/api/v1/jobs/"+job+"/quorum", &q) == nil && q.Epoch > epoch && len(q.Participants) == participants && q.PublishedBy != notBy {
				return true
			}
		}
		return false
	})
	return q
}

// proc is a running process whose standard error the test reads.
type proc struct {
	name string
	cmd  *exec.Cmd
	mu   sync.Mutex
	logs bytes.Buffer
	more chan struct{} // closed and replaced at every line
	done chan struct{}
}

func startProc(t *testing.T, name string, env []string, bin string, args ...string) *proc {
	t.Helper()
	p := &proc{name: name, cmd: exec.Command(bin, args...), more: make(chan struct{}), done: make(chan struct{})}
	p.cmd.Env = env
	stderr, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.cmd.Stdout = p.cmd.Stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { // exits at the process's end
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			p.mu.Lock()
			p.logs.WriteString(sc.Text() + "\n")
			close(p.more)
			p.more = make(chan struct{})
			p.mu.Unlock()
		}
		p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		<-p.done
		if t.Failed() {
			t.Logf("logs of %s:\n%s", name, tail(p.output(), 40))
		}
	})
	return p
}

func (p *proc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.logs.String()
}

func (p *proc) waitLog(t *testing.T, s string, d time.Duration) {
	t.Helper()
	deadline := time.After(d)
	for {
		p.mu.Lock()
		found, more := strings.Contains(p.logs.String(), s), p.more
		p.mu.Unlock()
		if found {
			return
		}
		select {
		case <-more:
		case <-p.done:
			t.Fatalf("%s exited without logging %q", p.name, s)
		case <-deadline:
			t.Fatalf("%s did not log %q within %v", p.name, s, d)
		}
	}
}

func (p *proc) wait(t *testing.T, d time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
		return p.cmd.ProcessState.ExitCode()
	case <-time.After(d):
		t.Fatalf("%s did not exit within %v", p.name, d)
		return -1
	}
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
