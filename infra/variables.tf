# Every variable has a description and a type (tests/test_infra.py checks it). Cross-variable
# rules (min <= max, target < max calls, ...) are lifecycle preconditions on the resources that
# use them, because a variable's validation may only refer to that variable in Terraform 1.5.

# --- naming and region -----------------------------------------------------------------------

variable "region" {
  description = "AWS region. g5 (A10G) capacity differs by region and zone; check before choosing."
  type        = string
  default     = "us-east-1"
}

variable "name" {
  description = "Name prefix for every resource (cluster, service, load balancers, log group)."
  type        = string
  default     = "ivr-gateway"

  validation {
    # Load balancer and target group names are at most 32 characters; suffixes add up to 8.
    condition     = can(regex("^[a-z][a-z0-9-]{1,22}[a-z0-9]$", var.name))
    error_message = "name: 3-24 characters, lower-case letters, digits and '-', starting with a letter."
  }
}

variable "tags" {
  description = "Extra tags put on every resource (provider default_tags)."
  type        = map(string)
  default     = {}
}

# --- network -----------------------------------------------------------------------------------

variable "vpc_id" {
  description = "Existing VPC to deploy into; null creates a VPC with public subnets (network.tf)."
  type        = string
  default     = null
}

variable "public_subnet_ids" {
  description = "Public subnets (two or more zones) of vpc_id for the load balancers and GPU hosts. Used only with vpc_id."
  type        = list(string)
  default     = []
}

variable "vpc_cidr" {
  description = "CIDR of the VPC created when vpc_id is null."
  type        = string
  default     = "10.40.0.0/16"

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0))
    error_message = "vpc_cidr must be a CIDR block such as 10.40.0.0/16."
  }
}

variable "availability_zones" {
  description = "Zones for the created VPC's subnets; empty: the region's first availability_zone_count zones. Pick zones that offer instance_type."
  type        = list(string)
  default     = []
}

variable "availability_zone_count" {
  description = "How many zones the created VPC spans when availability_zones is empty (ALB needs two)."
  type        = number
  default     = 2

  validation {
    condition     = var.availability_zone_count >= 2 && var.availability_zone_count <= 6
    error_message = "availability_zone_count must be 2-6 (an ALB needs subnets in two zones)."
  }
}

variable "associate_public_ip" {
  description = "Give GPU hosts a public IPv4 address. Required for SIP (RTP and in-dialog requests go straight to the host) and, without a NAT gateway, for pulling images and the model."
  type        = bool
  default     = true
}

# --- GPU hosts -----------------------------------------------------------------------------------

variable "instance_type" {
  description = "EC2 type of the GPU hosts. One task per host (host networking), so a single-GPU type: g5.xlarge (one A10G) is the reference."
  type        = string
  default     = "g5.xlarge"

  validation {
    # Single-GPU sizes only: a multi-GPU host (g5.12xlarge: 4 GPUs) would run one task and
    # leave the other GPUs idle, because every task binds the same host ports.
    condition     = can(regex("^(g4dn|g5|g6|g6e|gr6)\\.(xlarge|2xlarge|4xlarge|8xlarge|16xlarge)$", var.instance_type))
    error_message = "instance_type must be a single-GPU size of g4dn, g5, g6, g6e or gr6 (xlarge ... 16xlarge, not 12xlarge/24xlarge/48xlarge)."
  }
}

variable "ami_ssm_parameter" {
  description = "SSM public parameter holding the ECS GPU-optimised AMI id. Amazon Linux 2023's GPU AMI ships NVIDIA driver 580.x, which the image's CUDA 13 torch needs (>= 580); Amazon Linux 2's ships 550.x and needs an image built for CUDA 12 (docs/operators/deploy.md)."
  type        = string
  default     = "/aws/service/ecs/optimized-ami/amazon-linux-2023/gpu/recommended/image_id"
}

variable "root_volume_size_gb" {
  description = "Root EBS volume of a GPU host: Docker keeps the gateway image (about 9 GB, model included) and its previous version here."
  type        = number
  default     = 100

  validation {
    condition     = var.root_volume_size_gb >= 60
    error_message = "root_volume_size_gb must be at least 60 (the CUDA image alone is several GB)."
  }
}

# --- fleet size, deployment, scaling ----------------------------------------------------------------

variable "min_replicas" {
  description = "Fewest gateway tasks (each a whole gateway with one GPU); also the initial desired count."
  type        = number
  default     = 1

  validation {
    condition     = var.min_replicas >= 1 && floor(var.min_replicas) == var.min_replicas
    error_message = "min_replicas must be a whole number >= 1."
  }
}

variable "max_replicas" {
  description = "Most gateway tasks autoscaling may run (and the GPU host count it may reach, plus the deployment surge)."
  type        = number
  default     = 4

  validation {
    condition     = var.max_replicas >= 1 && floor(var.max_replicas) == var.max_replicas
    error_message = "max_replicas must be a whole number >= 1."
  }
}

variable "deployment_strategy" {
  description = "How a rolling update frees a GPU: 'surge' starts each replacement on an extra host first (no capacity dip, costs a spare GPU host during the rollout); 'stop_first' stops an old task first and reuses its GPU (no extra host; with one replica, no new calls until the new task is ready). See infra/README.md."
  type        = string
  default     = "surge"

  validation {
    condition     = contains(["surge", "stop_first"], var.deployment_strategy)
    error_message = "deployment_strategy must be 'surge' or 'stop_first'."
  }
}

variable "max_calls_per_task" {
  description = "GATEWAY_MAX_CALLS: calls one task takes before answering busy. Measure it with `gateway loadsim capacity` on instance_type."
  type        = number
  default     = 16

  validation {
    condition     = var.max_calls_per_task >= 1
    error_message = "max_calls_per_task must be >= 1."
  }
}

variable "target_calls_per_task" {
  description = "Autoscaling target: average active calls per task. Keep it below max_calls_per_task by the calls that arrive while a new GPU host boots and loads the model (several minutes)."
  type        = number
  default     = 10

  validation {
    condition     = var.target_calls_per_task > 0
    error_message = "target_calls_per_task must be > 0."
  }
}

variable "scale_out_cooldown_s" {
  description = "Seconds after a scale-out before another scale-out."
  type        = number
  default     = 60
}

variable "scale_in_cooldown_s" {
  description = "Seconds after a scale-in before another scale-in (a task stopping drains for up to drain_window_s)."
  type        = number
  default     = 600
}

variable "metrics_namespace" {
  description = "CloudWatch namespace the metrics sidecar publishes the gateway's Prometheus metrics under (the scaling policy reads it)."
  type        = string
  default     = "IvrGateway"
}

variable "cloudwatch_agent_image" {
  description = "CloudWatch agent image of the metrics sidecar (scrapes /metrics, publishes gateway_calls_active). Pin a version in production."
  type        = string
  default     = "public.ecr.aws/cloudwatch-agent/cloudwatch-agent:latest"
}

variable "container_insights" {
  description = "Enable ECS Container Insights on the cluster (extra CloudWatch cost)."
  type        = bool
  default     = false
}

# --- image and gateway settings -------------------------------------------------------------------

variable "ecr_repository_name" {
  description = "ECR repository for the gateway image; null: the name variable."
  type        = string
  default     = null
}

variable "ecr_immutable_tags" {
  description = "Make image tags immutable (a tag always means the same image; hosts may then reuse a cached pull)."
  type        = bool
  default     = true
}

variable "ecr_keep_images" {
  description = "ECR lifecycle: keep this many most recent images (untagged ones expire after a day)."
  type        = number
  default     = 30

  validation {
    condition     = var.ecr_keep_images >= 1
    error_message = "ecr_keep_images must be >= 1."
  }
}

variable "image_tag" {
  description = "Tag of the gateway image in the ECR repository to run."
  type        = string
  default     = "0.1.0"
}

variable "gateway_command" {
  description = "With sip_enabled: the gateway's full command line in the image (the Dockerfile's ENTRYPOINT + CMD), run after the shell wrapper that sets GATEWAY_SIP_PUBLIC_IP. Without SIP the image's own ENTRYPOINT/CMD run."
  type        = list(string)
  default     = ["/opt/venv/bin/gateway", "serve"]
}

variable "container_port" {
  description = "GATEWAY_PORT: the gateway's HTTP/WebSocket port on the host (host network mode)."
  type        = number
  default     = 8080

  validation {
    condition     = var.container_port >= 1024 && var.container_port <= 65535 && var.container_port != 5060
    error_message = "container_port must be 1024-65535 and not the SIP port 5060."
  }
}

variable "container_cpu" {
  description = "CPU units reserved for the gateway container (1024 = one vCPU; g5.xlarge has 4096)."
  type        = number
  default     = 3584
}

variable "container_memory_mib" {
  description = "Memory reservation (soft limit, MiB) of the gateway container (g5.xlarge has 16 GiB)."
  type        = number
  default     = 12288
}

variable "model_id" {
  description = "GATEWAY_MODEL override; null: the model baked into the image (Dockerfile MODEL_ID, /models/...). The image runs with HF_HUB_OFFLINE=1, so an override must be a path inside the image."
  type        = string
  default     = null
}

variable "ivr_script" {
  description = "GATEWAY_SCRIPT override: path inside the image of the IVR script (YAML); null: the image's (Dockerfile SCRIPT, /app/prompts/demo.yaml)."
  type        = string
  default     = null
}

variable "extra_environment" {
  description = "More plain GATEWAY_* settings for the container (e.g. GATEWAY_SPEAKER). Never secrets: those go through Secrets Manager."
  type        = map(string)
  default     = {}

  validation {
    condition = alltrue([
      for name in keys(var.extra_environment) :
      length(regexall("TOKEN|SECRET|PASSWORD|SIP_USERS", upper(name))) == 0
    ])
    error_message = "extra_environment must not carry secrets (TOKEN/SECRET/PASSWORD/SIP_USERS): use twilio_auth_token_secret_arn / sip_users_secret_arn."
  }
}

# --- public endpoint ---------------------------------------------------------------------------------

variable "certificate_arn" {
  description = "ACM certificate ARN for the ALB's HTTPS listener (covering domain_name). Twilio only calls valid https:// URLs."
  type        = string

  validation {
    condition     = can(regex("^arn:aws[a-z-]*:acm:", var.certificate_arn))
    error_message = "certificate_arn must be an ACM certificate ARN (arn:aws:acm:...)."
  }
}

variable "domain_name" {
  description = "Public host name of the gateway (the certificate's); null: the ALB's DNS name (only works with a certificate for it, so set this in production)."
  type        = string
  default     = null
}

variable "route53_zone_id" {
  description = "Route 53 hosted zone to create domain_name in as an alias of the ALB; null: manage DNS yourself."
  type        = string
  default     = null
}

variable "alb_ingress_cidrs" {
  description = "Who may reach the ALB on 443/80. Twilio's webhook and Media Streams addresses are not a small fixed list, so the world by default; signatures protect the endpoints."
  type        = list(string)
  default     = ["0.0.0.0/0"]
}

variable "max_call_duration_s" {
  description = "Longest call expected (seconds). The ALB idle timeout must be at least this long."
  type        = number
  default     = 3600
}

variable "alb_idle_timeout_s" {
  description = "ALB idle timeout (seconds): a connection with no data for this long is closed. At least max_call_duration_s; the ALB maximum is 4000."
  type        = number
  default     = 3600

  validation {
    condition     = var.alb_idle_timeout_s > 60 && var.alb_idle_timeout_s <= 4000
    error_message = "alb_idle_timeout_s must be > 60 (the ALB default cuts long calls) and <= 4000 (the ALB maximum)."
  }
}

# --- drain ---------------------------------------------------------------------------------------------

variable "drain_window_s" {
  description = "Target group deregistration delay: how long active calls may continue on a task that has left the load balancer before ECS sends SIGTERM; the load balancer closes connections still open at its end."
  type        = number
  default     = 900

  validation {
    condition     = var.drain_window_s >= 0 && var.drain_window_s <= 3600
    error_message = "drain_window_s must be 0-3600 (the target group maximum)."
  }
}

variable "sip_deregistration_delay_s" {
  description = "Deregistration delay of the SIP NLB target group. Short on purpose: the NLB keeps a trunk's existing UDP flow (every INVITE from one trunk socket) on a deregistering task until this ends, and the task is not refusing calls yet. Established SIP calls do not use the NLB (in-dialog requests and RTP go to the host directly) and keep going."
  type        = number
  default     = 30

  validation {
    condition     = var.sip_deregistration_delay_s >= 0 && var.sip_deregistration_delay_s <= 3600
    error_message = "sip_deregistration_delay_s must be 0-3600 (the target group maximum)."
  }
}

variable "drain_grace_s" {
  description = "GATEWAY_DRAIN_GRACE_S: after SIGTERM, how long calls may continue before the gateway hangs up and exits. Must fit inside the container stopTimeout (120 s, the ECS maximum) with 5 s to spare."
  type        = number
  default     = 110

  validation {
    condition     = var.drain_grace_s >= 0 && var.drain_grace_s <= 115
    error_message = "drain_grace_s must be 0-115: ECS sends SIGKILL 120 s after SIGTERM."
  }
}

variable "health_check_grace_s" {
  description = "Service health check grace period: seconds a new task may fail /readyz (model download and load, CUDA graph capture, prompt rendering) before ECS replaces it."
  type        = number
  default     = 600

  validation {
    condition     = var.health_check_grace_s >= 120
    error_message = "health_check_grace_s must be >= 120: model load and CUDA graph capture take minutes."
  }
}

# --- logs and secrets ------------------------------------------------------------------------------------

variable "log_retention_days" {
  description = "CloudWatch Logs retention of the gateway's and the metrics sidecar's logs."
  type        = number
  default     = 30

  validation {
    condition     = contains([1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.log_retention_days)
    error_message = "log_retention_days must be a CloudWatch Logs retention value (1, 3, 5, 7, 14, 30, 60, 90, ...)."
  }
}

variable "twilio_account_sid" {
  description = "GATEWAY_TWILIO_ACCOUNT_SID: the Twilio account (AC...) whose calls the tasks update. Set it: with several tasks behind the ALB, the task running a call's stream sends the call's transfer or hang-up to Twilio as a live-call update (REST API, authenticated with the auth token secret); without it, /twilio/after-stream may reach a task that does not know the call's transfer. null: one task only."
  type        = string
  default     = null

  validation {
    condition     = var.twilio_account_sid == null || can(regex("^AC[0-9a-f]{32}$", var.twilio_account_sid))
    error_message = "twilio_account_sid must be AC followed by 32 hex digits (the Account SID on the Twilio console)."
  }
}

variable "twilio_auth_token_secret_arn" {
  description = "Existing Secrets Manager secret (whole-secret ARN) holding the Twilio auth token; null creates an empty one whose value you set out of band."
  type        = string
  default     = null

  validation {
    condition     = var.twilio_auth_token_secret_arn == null || can(regex("^arn:aws[a-z-]*:secretsmanager:[^:]+:[0-9]{12}:secret:[^:]+$", var.twilio_auth_token_secret_arn))
    error_message = "twilio_auth_token_secret_arn must be a whole Secrets Manager secret ARN (no JSON key suffix)."
  }
}

variable "sip_users_secret_arn" {
  description = "Secrets Manager secret (whole-secret ARN) with GATEWAY_SIP_USERS ('name:password,...') for SIP digest authentication; null: no digest authentication."
  type        = string
  default     = null

  validation {
    condition     = var.sip_users_secret_arn == null || can(regex("^arn:aws[a-z-]*:secretsmanager:[^:]+:[0-9]{12}:secret:[^:]+$", var.sip_users_secret_arn))
    error_message = "sip_users_secret_arn must be a whole Secrets Manager secret ARN (no JSON key suffix)."
  }
}

variable "secrets_kms_key_arn" {
  description = "Customer-managed KMS key the secrets are encrypted with (the execution role gets kms:Decrypt on it); null: the AWS-managed key."
  type        = string
  default     = null
}

# --- SIP --------------------------------------------------------------------------------------------------

variable "sip_enabled" {
  description = "Serve SIP/RTP as well: an NLB with a UDP 5060 listener, the SIP/RTP security group rules, GATEWAY_SIP and GATEWAY_RTP_PORTS."
  type        = bool
  default     = false
}

variable "sip_trunk_cidrs" {
  description = "CIDRs of the SIP trunk's signalling addresses: the only sources allowed to UDP 5060 (also GATEWAY_SIP_ALLOW)."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for cidr in var.sip_trunk_cidrs : can(cidrhost(cidr, 0)) && cidr != "0.0.0.0/0"])
    error_message = "sip_trunk_cidrs must be CIDR blocks, and not 0.0.0.0/0."
  }
}

variable "rtp_source_cidrs" {
  description = "CIDRs the trunk sends media (RTP) from, if they differ from sip_trunk_cidrs; empty: sip_trunk_cidrs."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for cidr in var.rtp_source_cidrs : can(cidrhost(cidr, 0)) && cidr != "0.0.0.0/0"])
    error_message = "rtp_source_cidrs must be CIDR blocks, and not 0.0.0.0/0."
  }
}

variable "rtp_port_min" {
  description = "First UDP port of the RTP range (GATEWAY_RTP_PORTS), one port per call."
  type        = number
  default     = 20000
}

variable "rtp_port_max" {
  description = "Last UDP port of the RTP range (GATEWAY_RTP_PORTS)."
  type        = number
  default     = 20999
}
