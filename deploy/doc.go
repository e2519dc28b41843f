// Package deploy holds what it takes to run ftcomm on a cluster
// (docs/deploy.md walks through it), and the tests that the walkthrough's
// topology works:
//
//	Dockerfile                   the ftcoord and trainer images, for Docker/BuildKit users
//	build-image.sh               the same images without a Docker daemon: reproducible OCI layouts in build/image
//	check-image.sh               what CI does with them: checks, runs ftcoord --version from the layout, rebuilds
//	mkimage/                     writes those OCI layouts (go-containerregistry) and checks one
//	kubernetes/                  kustomize bases and overlays: etcd, ftcoord (3 replicas or single), a training Job
//	k8sschema/                   Kubernetes' and cert-manager's OpenAPI documents as kubeconform's JSON schemas
//	validate.sh                  renders every overlay and validates it strictly with kubeconform (CI runs it)
//	etcd/                        the etcd server of the version this module pins, for the loopback tests
//
// TestLoopbackDeployment (loopback_test.go) runs the topology of
// kubernetes/overlays/ha as processes on loopback, with the manifests' own
// arguments and environment (only names, ports and paths mapped): a
// 3-member etcd cluster with TLS, client certificates and authentication,
// etcd-init, three ftcoord instances, trainers joining with the
// credentials file, the leader SIGKILLed, graceful stops. It takes about
// 13 s. TestLoopbackSizing (sizing_test.go, opt-in with
// -args -deploy.members=N) measures the sizing figures of docs/deploy.md
// on the same topology.
package deploy
