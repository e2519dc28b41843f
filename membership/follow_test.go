package membership_test

import (
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

// A client whose etcd moved (restarted on another port, the credentials
// file rewritten) follows the file: its calls succeed at the new endpoint,
// secured or not, without a new client.
func TestCredentialsFollow(t *testing.T) {
	for _, secure := range []bool{false, true} {
		t.Run(fmt.Sprintf("secure=%v", secure), func(t *testing.T) {
			ctx := clustertest.Ctx(t, 60*time.Second)
			cfg := etcdhost.DefaultEmbeddedConfig()
			cfg.Dir, cfg.UnsafeNoFsync, cfg.Secure = t.TempDir(), true, secure
			e, err := etcdhost.StartEmbedded(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(t.TempDir(), "credentials.json")
			creds := clustertest.Credentials(t, e, etcdhost.UserTrainer)
			if err := membership.WriteCredentials(path, creds); err != nil {
				t.Fatal(err)
			}
			cli, err := creds.NewClient(nil)
			if err != nil {
				t.Fatal(err)
			}
			defer cli.Close()
			followed := make(chan struct{})
			go func() {
				defer close(followed)
				creds.Follow(cli.Ctx(), cli, path, zaptest.NewLogger(t))
			}()
			defer func() { cli.Close(); <-followed }()
			key := etcdkeys.DefaultRoot + "/job/k"
			if _, err := cli.Put(ctx, key, "v"); err != nil {
				t.Fatal(err)
			}
			e.Close()

			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			cfg.ClientAddr = l.Addr().String()
			l.Close()
			e, err = etcdhost.StartEmbedded(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			moved := clustertest.Credentials(t, e, etcdhost.UserTrainer)
			if err := membership.WriteCredentials(path, moved); err != nil {
				t.Fatal(err)
			}
			resp, err := cli.Get(clustertest.Ctx(t, 20*time.Second), key)
			if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v" {
				t.Fatalf("after the move: %v, %v", resp, err)
			}
			if !slices.Equal(cli.Endpoints(), moved.Endpoints) {
				t.Fatalf("client endpoints %v, file's %v", cli.Endpoints(), moved.Endpoints)
			}
		})
	}
}
